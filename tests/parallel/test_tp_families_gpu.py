"""Tensor parallelism for every decoder family on GPUs (NCCL, 2 ranks, bf16): the ranks' logits of
a 40-token prompt (windows of 8 keys bite) are as close to transformers' float32 logits as the
one-GPU family test bounds the one-GPU model (1.5x transformers' own bf16 error plus a bf16
ulp-scale slack), and the same 2-rank engine then decodes 12 greedy tokens (CUDA graphs on). A
family whose layers need a kernel feature not built yet runs the reference attention (the
one-GPU test checks that refusal by name).

Needs at least 2 GPUs:  PYTHONPATH=$PWD python -m pytest -q -m gpu tests/parallel/test_tp_families_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from helpers.extras import require
from helpers.hf_families import FAMILY_CASES, hf_logits, write_family_checkpoint
from helpers.tp import device_logits

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.errors import ImplUnavailableError
from sparsegen.models import ForwardBatch, load_checkpoint
from sparsegen.parallel.source import ModelSource

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs >= 2 CUDA GPUs"),
]
PROMPT = [(7 * i + 3) % 90 + 1 for i in range(40)]


def _attn_impl(folder) -> str | None:
    """None (the compiled kernels) when one GPU runs them for this family, else "reference"."""
    model = load_checkpoint(folder, device="cuda", dtype=torch.bfloat16)
    try:
        model(torch.tensor(PROMPT, device="cuda"), ForwardBatch.whole_sequences([len(PROMPT)], device="cuda"))
    except ImplUnavailableError:
        return "reference"
    finally:
        del model
        torch.cuda.empty_cache()
    return None


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_two_gpu_ranks_track_transformers_within_bf16(tmp_path, family):
    require("transformers")
    folder, hf = write_family_checkpoint(tmp_path / "ckpt", family)
    want32 = hf_logits(hf.to("cuda", torch.float32), PROMPT)[-1].cpu()
    hf16 = hf_logits(hf.to("cuda", torch.bfloat16), PROMPT)[-1].cpu()
    del hf
    torch.cuda.empty_cache()
    impl = _attn_impl(folder)
    source = ModelSource(model_dir=str(folder), dtype="bfloat16", attn_impl=impl)
    with LLMEngine(source, tensor_parallel_size=2, device="cuda", kv_cache_bytes=64 << 20) as engine:
        got = engine.executor.call(device_logits, PROMPT)
        out = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    bound = 1.5 * (hf16 - want32).abs().max().item() + 1e-2 * want32.abs().max().item()
    assert (got - want32).abs().max().item() <= bound
    assert len(out) == 12 and all(0 <= t < hf16.shape[-1] for t in out)
