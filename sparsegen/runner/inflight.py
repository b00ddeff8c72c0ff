"""One decode step ahead of the host: what a launched step carries until its tokens are read.

`LLMEngine.step()` launches a step (forward pass and sampler, queued on the device), and reads
its tokens back only after it has launched the next decode step, when that is exact
(`Scheduler.schedule_lookahead`): the next step's input ids are the launched step's sampled
tokens, passed on the device (`Plan.input_ids`), so the host's work for step n+1 (planning,
positions, slots, pages, block tables, the copies) runs while the GPU computes step n, and the
GPU goes from step n to step n+1 without waiting for the host. On a CPU the same code runs
synchronously (every tensor is already on the host), which is how the CPU tests check it.

Why freeing pages while a step is in flight is safe: every kernel and copy of every step is
queued on one stream (the current one) in launch order. A page freed by a finish or an abort
may still be written by the step in flight (the discarded extra token of a finished sequence,
or an aborted row), but whatever is given that page later is written by a step launched later,
so it runs after the in-flight one. No host buffer is handed to a pending copy either: host to
device copies go through pinned blocks of the caching host allocator, which keeps each block
until its copy has run (`runner.transfer`), and each launched step reads its tokens into
pinned buffers of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..request.sequence import Plan
from .sampling import SamplerOutput


class PendingOutput(Protocol):
    """Where a launched step's tokens are read from: a `sampling.DeviceSample` on its way to
    pinned host memory, or a tensor-parallel executor's answer from rank 0."""

    def output(self) -> SamplerOutput: ...


@dataclass(frozen=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    plan: Plan
    # [len(plan.sampled)] int64 on this process's device; None if nothing was sampled, or if the
    # step runs in tensor-parallel ranks (each keeps its own copy for the next lookahead step)
    tokens: torch.Tensor | None
    host: PendingOutput | None  # None if nothing was sampled

    def output(self) -> SamplerOutput:
        """The sampled tokens (and log-probabilities); waits for the step to end on a GPU."""
        return self.host.output() if self.host is not None else SamplerOutput([], [])


def overlappable(plan: Plan) -> bool:
    """May the next step be launched before `plan`'s tokens are on the host? Only after a decode
    step, and only if no row needs its previous token's value on the host to be sampled
    (repetition, presence and frequency penalties count the output tokens; a grammar's mask
    follows from the tokens so far)."""
    return plan.is_decode and not any(
        c.seq.params.has_penalties or c.seq.params.has_structured_output for c in plan.chunks
    )
