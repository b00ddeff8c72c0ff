"""One request's failure inside a step fails that request alone.

The sampler runs over the whole batch at once, so one row that it cannot handle would fail
every row. `sample_isolating` runs the batch; if that raises, it samples each row on its own
to find the rows that fail, then samples the others together again, and names the failed rows
in the result (`DeviceSample.failed`, then `SamplerOutput.failed`). When the engine books the
step it fails those requests (an error event, their pages freed) and books the rest as usual. Requests are checked
when they are made (`engine.checks`), so this path is for what slipped through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..request.sampling_params import SamplingParams
from . import sampling


def sample_isolating(
    logits: torch.Tensor,  # [B, V] float32
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]],
    *,
    eos_token_id: int | None,
    num_generated: Sequence[int],
    token_bitmask: torch.Tensor | None = None,  # [B, W] int32 host: grammar masks
) -> sampling.DeviceSample:
    """`sampling.sample_on_device` over the batch, with `failed` naming the rows that failed
    alone and why ("TypeName: message", plain text, so it crosses a process boundary); their
    tokens are 0. If the rows that pass alone fail together, that error is raised (the step
    fails, as without isolation). Deterministic rows fail alike on every tensor-parallel rank."""

    def run(rows: list[int]) -> sampling.DeviceSample:
        # the whole batch (every step that does not fail) samples the logits as they are: no
        # row gather, no host-to-device copy, nothing that would wait for the GPU
        picked = logits if len(rows) == logits.shape[0] else logits[rows]
        return sampling.sample_on_device(
            picked,
            [params[r] for r in rows],
            [output_ids[r] for r in rows],
            [prompt_ids[r] for r in rows],
            eos_token_id=eos_token_id,
            num_generated=[num_generated[r] for r in rows],
            token_bitmask=None if token_bitmask is None else token_bitmask[rows],
        )

    everyone = list(range(logits.shape[0]))
    try:
        return run(everyone)
    except Exception:  # noqa: BLE001 - find out whose it is below
        pass
    failed: dict[int, str] = {}
    for r in everyone:
        try:
            run([r])
        except Exception as exc:  # noqa: BLE001 - this row's own failure, reported to its request
            failed[r] = f"{type(exc).__name__}: {exc}"[:500]
    if not failed:  # every row passes alone: not one request's fault
        return run(everyone)
    good = [r for r in everyone if r not in failed]
    reasons = tuple(failed.items())
    tokens = torch.zeros(len(everyone), dtype=torch.long, device=logits.device)  # [B]
    if not good:
        return sampling.DeviceSample(tokens, failed=reasons)
    out = run(good)
    tokens[good] = out.token_ids
    rows = tuple(good[j] for j in out.logprob_rows)
    return replace(out, token_ids=tokens, logprob_rows=rows, failed=reasons)
