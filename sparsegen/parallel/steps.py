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

from typing import TYPE_CHECKING

import torch

from ..request.sampling_params import SamplingParams
from ..request.sequence import Chunk, Plan, Sequence

if TYPE_CHECKING:
    import numpy

# The messages are plain tuples: a queue pickles them in C, where a dataclass or NamedTuple per
# sequence would cost a Python call each way (several times the whole tuple's cost for 32 rows).
#
# One sequence's news for the ranks:
#   (seq_id, tokens, pages, whole_table, prompt_ids, params)
#   tokens: output tokens booked since it was last sent; pages: pages appended since, or the
#   whole block table when whole_table; prompt_ids and params: the first time only, else None.
SeqUpdate = tuple[int, list[int], list[int], bool, "list[int] | None", "SamplingParams | None"]
# One launched step:
#   (is_decode, lookahead, chunks, updates, forget, token_bitmask, eos_token_id)
#   lookahead: input ids are the previous step's tokens, which every rank keeps; chunks:
#   (seq_id, start, stop) each; forget: sequences that ended, whose copies the ranks drop;
#   token_bitmask: the plan's grammar masks (`Plan.token_bitmask`, [sampled, W] int32) as a numpy
#   array, pickled by value (a torch tensor would go through shared memory), or None. Every rank
#   samples every row, so every rank applies the masks and draws the same constrained tokens.
StepMessage = tuple[
    bool, bool, tuple[tuple[int, int, int], ...], tuple[SeqUpdate, ...], tuple[int, ...], "numpy.ndarray | None",
    "int | None",
]  # fmt: skip


class StepEncoder:
    """The driver's side: what the ranks know of each sequence, and the message of each plan."""

    def __init__(self) -> None:
        # seq_id -> (sequence, output tokens sent, page_epoch sent, pages sent)
        self._sent: dict[int, tuple[Sequence, int, int, int]] = {}

    def encode(self, plan: Plan, eos_token_id: int | None) -> StepMessage:
        """The message for `plan`, as its sequences are now (called when it is launched)."""
        sent = self._sent
        forget = tuple(i for i, known in sent.items() if known[0].finish_reason is not None)
        for i in forget:
            del sent[i]
        updates, chunks = [], []
        for c in plan.chunks:
            seq = c.seq
            known = sent.get(seq.seq_id)
            if known is None:
                updates.append(
                    (seq.seq_id, list(seq.output_ids), list(seq.pages), True, seq.prompt_ids, seq.params)
                )
            else:
                _, n_out, epoch, n_pages = known
                whole = epoch != seq.page_epoch
                pages = list(seq.pages) if whole else seq.pages[n_pages:]
                updates.append((seq.seq_id, seq.output_ids[n_out:], pages, whole, None, None))
            sent[seq.seq_id] = (seq, len(seq.output_ids), seq.page_epoch, len(seq.pages))
            chunks.append((seq.seq_id, c.start, c.stop))
        mask = None if plan.token_bitmask is None else plan.token_bitmask.numpy()  # [sampled, W] int32
        return plan.is_decode, plan.lookahead, tuple(chunks), tuple(updates), forget, mask, eos_token_id


class RankSequences:
    """A rank's side: its copies of the driver's sequences, and the plan of each message."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def plan(self, msg: StepMessage) -> Plan:
        is_decode, lookahead, chunks, updates, forget, mask, _ = msg
        seqs = self.seqs
        for i in forget:
            seqs.pop(i, None)
        for seq_id, tokens, pages, whole_table, prompt_ids, params in updates:
            seq = seqs.get(seq_id)
            if seq is None:
                seq = seqs[seq_id] = Sequence(seq_id, prompt_ids, params)
            seq.output_ids.extend(tokens)
            if whole_table:
                seq.pages = list(pages)  # a new list: the copy's page_epoch moves on too
            else:
                seq.pages.extend(pages)
        return Plan(
            is_decode,
            tuple(Chunk(seqs[i], start, stop) for i, start, stop in chunks),
            lookahead=lookahead,
            token_bitmask=None if mask is None else torch.from_numpy(mask),
        )
