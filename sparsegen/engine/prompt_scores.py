"""Booking prompt log-probabilities (`SamplingParams.prompt_logprobs`) on their sequences.

Each prefill step's `SamplerOutput.prompt_logprobs` scores some prompt tokens of some of the
step's sequences (`runner.prompt_logprobs`). They are kept on the `Sequence` in prompt order, the
first token's entry None, and handed out once, on the sequence's first token event. A sequence
recomputed after a preemption scores its prompt again; what it had already booked is kept (the
same positions give the same values) and only the rest is added.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from ..errors import EngineError
from ..request.sampling_params import PromptLogprobs, TokenLogprobs
from ..request.sequence import Plan, Sequence


def book_prompt_logprobs(plan: Plan, scores: Seq[PromptLogprobs]) -> None:
    """Add each chunk's scores to its sequence (a finished or aborted one is skipped)."""
    if not scores:
        return
    seqs = {c.seq.seq_id: c.seq for c in plan.chunks}
    for part in scores:
        seq = seqs.get(part.seq_id)
        if seq is None or seq.finish_reason is not None:
            continue
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        have = len(seq.prompt_logprobs)
        if part.first > have:  # a chunk always starts where the computed prompt ends
            raise EngineError(
                f"sequence {seq.seq_id}: prompt log-probabilities from token {part.first}, "
                f"but only {have} are booked"
            )
        seq.prompt_logprobs.extend(part.items[have - part.first :])


def first_prompt_logprobs(seq: Sequence) -> tuple[TokenLogprobs | None, ...] | None:
    """The prompt log-probabilities to hand out with `seq`'s newest token: all of them on its
    first token (one per prompt token), else None."""
    if seq.params.prompt_logprobs is None or len(seq.output_ids) != 1:
        return None
    scores = seq.prompt_logprobs or [None]
    if len(scores) != len(seq.prompt_ids):
        raise EngineError(
            f"sequence {seq.seq_id}: {len(scores)} prompt log-probabilities for {len(seq.prompt_ids)} tokens"
        )
    return tuple(scores)
