"""Functions that `MultiprocExecutor.call` runs on every tensor-parallel rank (module level, so they pickle),
the configs of the tensor-parallel tests, and process-state checks read from /proc."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from helpers.checkpoint import TINY_HF_CONFIG

# A second tiny config with 4 KV heads (TP = 4 possible), 8 query heads, and a vocabulary that 4
# ranks do not divide (270 = 4 * 68 - 2), so the vocab-parallel lm_head's zero padding is used.
WIDE_HF_CONFIG = {
    **TINY_HF_CONFIG,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "ff_intermediate_size": 256,
    "vocab_size": 270,
    "dummy_token_indices": list(range(261, 270)),
}


def rank_facts(ctx) -> list[dict]:
    """Every rank's layer specs, KV cache shape and page count, gathered to rank 0."""
    model, runner = ctx.model, ctx.runner
    facts = {
        "rank": ctx.info.rank,
        "offsets": [[h.vert_offset for h in layer.heads] for layer in model.spec.layers],
        "global_offsets": [[h.vert_offset for h in layer.heads] for layer in model.global_spec.layers],
        "attn_layer_offsets": [[h.vert_offset for h in b.self_attn.layer.heads] for b in model.model.layers],
        "num_heads": model.spec.layers[0].num_heads,
        "kv_cache_shape": tuple(runner.cache.k[0].shape),
        "num_pages": runner.cache.num_pages,
        "lm_head_rows": model.lm_head.weight.shape[0],
    }
    out = [None] * ctx.info.world_size
    dist.all_gather_object(out, facts)
    return out


def last_logits(ctx, prompt: list[int]) -> torch.Tensor:
    """The logits of the prompt's last position through the rank's sharded model (no cache)."""
    from sparsegen.models import ForwardBatch

    batch = ForwardBatch.whole_sequences([len(prompt)])
    with torch.inference_mode():
        return ctx.model(torch.tensor(prompt), batch)[-1].clone()


def die_on_forward(ctx, rank: int, after: int, code: int) -> None:
    """Arm rank `rank` to exit with `code` (no report, like a crash) on its `after`-th forward."""
    if ctx.info.rank != rank:
        return
    model, calls = ctx.model, [0]
    forward = model.forward

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= after:
            os._exit(code)
        return forward(*args, **kwargs)

    model.forward = dying


def hang_on_forward(ctx, rank: int) -> None:
    """Arm rank `rank` to stall, alive, in its next forward (the others wait in a collective)."""
    if ctx.info.rank != rank:
        return

    def stuck(*args, **kwargs):
        time.sleep(3600)

    ctx.model.forward = stuck


def unpicklable_result(ctx):
    """A value that cannot go back over a queue (a lock)."""
    import threading

    return threading.Lock()


def exited(pid: int) -> bool:
    """Whether process `pid` is gone (a zombie has exited too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """The processes that process `pid`'s main thread started."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def device_logits(ctx, prompt: list[int]) -> torch.Tensor:
    """`last_logits` on the rank's device (a GPU rank's), returned on the CPU in float32."""
    from sparsegen.models import ForwardBatch

    dev = ctx.info.device
    batch = ForwardBatch.whole_sequences([len(prompt)], device=dev)
    with torch.inference_mode():
        return ctx.model(torch.tensor(prompt, device=dev), batch)[-1].float().cpu()
