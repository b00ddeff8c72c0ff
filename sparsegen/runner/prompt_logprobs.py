"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) from a prefill step's logits.

A prefill step normally computes logits for the last row of each sequence it completes. For a
sequence that asked for prompt_logprobs, `ModelRunner.prepare_prefill` also asks for the rows of
its chunk's `scored_positions`: position p's logits score prompt token p + 1. Those rows follow
the sampled rows in the step's logits, chunk by chunk in plan order. `score_prompt` turns them
into the scored token's log-probability and the top k (k = the request's prompt_logprobs), from
the model's raw logits (no logit processor, penalty or temperature), as tensors on the logits'
device; `DevicePromptLogprobs.output()` reads them as `PromptLogprobs`, one per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..request.sampling_params import PromptLogprobs, TokenLogprobs
from ..request.sequence import Chunk, Plan
from .transfer import packed_to_device


@dataclass(frozen=True)
class DevicePromptLogprobs:
    """One step's prompt log-probabilities before the host reads them."""

    spans: tuple[tuple[int, int, int, int], ...]  # per chunk: (seq_id, first token, count, k)
    chosen: torch.Tensor  # [R] float32: each scored token's log-probability
    ranks: torch.Tensor  # [R] int64: 1 + how many tokens are more likely than the scored one
    top_ids: torch.Tensor | None  # [R, kmax] int64 (None when every k is 0)
    top_values: torch.Tensor | None  # [R, kmax] float32
    targets: tuple[tuple[int, ...], ...]  # per chunk: the scored prompt tokens

    def to_host(self, pinned: Callable[[torch.Tensor | None], torch.Tensor | None]) -> DevicePromptLogprobs:
        """Copies through `pinned` (the caller records the event that says they are done)."""
        return replace(self, chosen=pinned(self.chosen), ranks=pinned(self.ranks),
                       top_ids=pinned(self.top_ids), top_values=pinned(self.top_values))  # fmt: skip

    def output(self) -> tuple[PromptLogprobs, ...]:
        """As Python values (after the copies `to_host` started have run)."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_i = self.top_ids.tolist() if self.top_ids is not None else None
        top_v = self.top_values.tolist() if self.top_values is not None else None
        out, row = [], 0
        for (seq_id, first, count, k), targets in zip(self.spans, self.targets, strict=True):
            items = []
            for j in range(count):
                top = tuple(zip(top_i[row][:k], top_v[row][:k], strict=True)) if k else ()
                items.append(TokenLogprobs(targets[j], chosen[row], top, ranks[row]))
                row += 1
            out.append(PromptLogprobs(seq_id, first, tuple(items)))
        return tuple(out)


def scored_rows(chunks: Seq[Chunk], cu_q: list[int]) -> np.ndarray:  # [R] int64
    """The rows (of the step's packed tokens; chunk i starts at row cu_q[i]) whose logits score
    a prompt token, chunk by chunk in plan order."""
    parts = [
        np.arange(r + s.start - c.start, r + s.stop - c.start, dtype=np.int64)
        for c, r in zip(chunks, cu_q, strict=False)
        if (s := c.scored_positions)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def score_prompt(logits: torch.Tensor, plan: Plan) -> DevicePromptLogprobs:
    """logits: [R, V] float32, the rows of `scored_rows(plan, ...)` in order."""
    spans, targets = [], []
    for c in plan.chunks:
        s = c.scored_positions
        if s:
            k = c.seq.params.prompt_logprobs
            spans.append((c.seq.seq_id, s.start + 1, len(s), k))
            targets.append(tuple(c.seq.prompt_ids[s.start + 1 : s.stop + 1]))
    ids = np.fromiter((t for ts in targets for t in ts), dtype=np.int64)
    (target_d,) = packed_to_device([ids], torch.long, logits.device)  # [R]
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, target_d[:, None])[:, 0]  # [R]
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1  # [R] int64 (vLLM's rank: ties share the best)
    kmax = max(k for *_, k in spans)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)  # [R, kmax]
    return DevicePromptLogprobs(tuple(spans), chosen, ranks, top_i, top_v, tuple(targets))
