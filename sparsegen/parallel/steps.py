"""What the driver sends the tensor-parallel ranks for one step, and how each side keeps the ranks'
copy of the sequences.

The driver's `LLMEngine` owns the sequences: their tokens, pages and sampling parameters. A rank
needs the same `Sequence` objects to run a `Plan` through its `ModelRunner`, so it keeps a copy of
each sequence that a plan named (`RankSequences`). Each launched step is sent as a `StepMessage`:
the plan's chunks by sequence id, and for each of their sequences only what changed since it was
last sent (`SeqUpdate`: the prompt and parameters once, then the output tokens booked since and the
pages added since, or the whole block table when the scheduler replaced it). A decode step of 32
sequences is then 32 small updates, most of them one token, whatever the sequences' lengths.
Sequences that ended are named once in `forget`, and the ranks drop them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Chunk, Plan, Sequence


@dataclass(frozen=True, slots=True)
class SeqUpdate:
    """One sequence's news for the ranks."""

    seq_id: int
    tokens: list[int]  # output tokens booked since it was last sent
    pages: list[int]  # pages appended since, or the whole block table when `whole_table`
    whole_table: bool
    prompt_ids: list[int] | None = None  # the first time only
    params: SamplingParams | None = None  # the first time only


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One launched step: the plan by sequence id, with the updates it needs."""

    is_decode: bool
    lookahead: bool  # input ids are the previous step's tokens, which every rank keeps
    chunks: tuple[tuple[int, int, int], ...]  # (seq_id, start, stop)
    updates: tuple[SeqUpdate, ...]
    forget: tuple[int, ...]  # sequences that ended: the ranks drop their copies
    eos_token_id: int | None


class StepEncoder:
    """The driver's side: what the ranks know of each sequence, and the message of each plan."""

    def __init__(self) -> None:
        # seq_id -> (sequence, output tokens sent, page_epoch sent, pages sent)
        self._sent: dict[int, tuple[Sequence, int, int, int]] = {}

    def encode(self, plan: Plan, eos_token_id: int | None) -> StepMessage:
        """The message for `plan`, as its sequences are now (called when it is launched)."""
        forget = tuple(i for i, (s, *_) in self._sent.items() if s.finish_reason is not None)
        for i in forget:
            del self._sent[i]
        updates = []
        for c in plan.chunks:
            seq = c.seq
            known = self._sent.get(seq.seq_id)
            if known is None:
                update = SeqUpdate(seq.seq_id, list(seq.output_ids), list(seq.pages), True,
                                   seq.prompt_ids, seq.params)  # fmt: skip
            else:
                _, n_out, epoch, n_pages = known
                whole = epoch != seq.page_epoch
                pages = list(seq.pages) if whole else seq.pages[n_pages:]
                update = SeqUpdate(seq.seq_id, seq.output_ids[n_out:], pages, whole)
            self._sent[seq.seq_id] = (seq, len(seq.output_ids), seq.page_epoch, len(seq.pages))
            updates.append(update)
        chunks = tuple((c.seq.seq_id, c.start, c.stop) for c in plan.chunks)
        return StepMessage(plan.is_decode, plan.lookahead, chunks, tuple(updates), forget, eos_token_id)


class RankSequences:
    """A rank's side: its copies of the driver's sequences, and the plan of each message."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def plan(self, msg: StepMessage) -> Plan:
        for i in msg.forget:
            self.seqs.pop(i, None)
        for u in msg.updates:
            seq = self.seqs.get(u.seq_id)
            if seq is None:
                seq = self.seqs[u.seq_id] = Sequence(u.seq_id, u.prompt_ids, u.params)
            seq.output_ids += u.tokens
            if u.whole_table:
                seq.pages = list(u.pages)  # a new list: the copy's page_epoch moves on too
            else:
                seq.pages += u.pages
        chunks = tuple(Chunk(self.seqs[i], start, stop) for i, start, stop in msg.chunks)
        return Plan(msg.is_decode, chunks, lookahead=msg.lookahead)
