"""Constrained decoding for the engine: one grammar matcher per constrained sequence.

`StructuredOutputs` belongs to one `LLMEngine`:
- `compile(params)` builds a matcher for a request's `structured_outputs` (InputError naming the
  problem when it does not compile), before the request is queued; `add(seq_id, matcher)`
  keeps it for the sequence;
- `bitmask(seqs)` writes, before a step is launched, each constrained sampled row's mask of
  allowed next tokens (`runner.token_mask` applies it to the logits; rows of free requests are
  left zero and ignored);
- `advance(seq_id, token)` feeds each booked token to its matcher: None when the token was
  allowed, else why not; `complete(seq_id)` says the grammar is finished; `book(...)` does both
  for a booked token and ends the sequence when its grammar is complete (finish reason
  "grammar", which outputs report as "stop");
- `drop(seq_id)` forgets a sequence that finished or was aborted.

Because a mask follows from the tokens so far, a constrained sequence's step is never launched
ahead of the previous step's tokens (`runner.inflight.overlappable`). A preempted sequence keeps
its output tokens and so its matcher's state. The tokenizer's view for llguidance is built on
the first constrained request (it walks the vocabulary once) under a lock, since a front end
may check a request (`check`) from another thread than the one that steps the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..errors import InputError
from ..request.sampling_params import SamplingParams
from ..request.sequence import Sequence as Seq
from ..runner.token_mask import words_for
from . import grammar

GRAMMAR_FINISH = "grammar"  # the engine's finish reason for a completed grammar


class StructuredOutputs:
    def __init__(
        self, tokenizer: Callable[[], object], vocab_size: int, eos_token_id: Callable[[], int | None]
    ):
        self._tokenizer = tokenizer
        self._eos = eos_token_id
        self.vocab_size = vocab_size
        self.words = words_for(vocab_size)
        self._info = None
        self._lock = threading.Lock()
        self._matchers: dict[int, object] = {}  # seq_id -> llguidance.LLMatcher
        self._errors: dict[int, str] = {}  # seq_id -> why its matcher failed while masking

    def _tokenizer_info(self):
        with self._lock:
            if self._info is None:
                self._info = grammar.tokenizer_info(self._tokenizer(), self.vocab_size, self._eos())
            return self._info

    def compile(self, params: SamplingParams):
        """A fresh matcher for `params.structured_outputs` (InputError if it does not compile)."""
        return grammar.compile_matcher(params.structured_outputs, self._tokenizer_info())

    def check(self, params: SamplingParams) -> None:
        """Raise InputError now if `params`' grammar would not compile for this engine."""
        if params.has_structured_output:
            self.compile(params)

    def add(self, seq_id: int, matcher) -> None:
        self._matchers[seq_id] = matcher

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self._errors.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def bitmask(self, seqs: Sequence[Seq]) -> torch.Tensor | None:
        """[len(seqs), W] int32: the allowed next tokens of each constrained sequence (its bits),
        zero for the others; None if none of `seqs` is constrained."""
        rows = [(i, self._matchers[s.seq_id]) for i, s in enumerate(seqs) if s.seq_id in self._matchers]
        if not rows:
            return None
        mask = torch.zeros(len(seqs), self.words, dtype=torch.int32)  # [B, W]
        nbytes = self.words * 4
        for i, m in rows:
            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), nbytes)  # writes the row in place
            if m.is_error():  # a limit hit while masking: the row stays 0 and fails alone
                mask[i] = 0
                self._errors[seqs[i].seq_id] = grammar.first_error(m.get_error())
        return mask

    def error_of(self, seq_id: int) -> str | None:
        """Why a sequence's matcher failed while masking (its row failed), if it did."""
        return self._errors.get(seq_id)

    def advance(self, seq_id: int, token: int) -> str | None:
        """Feed a booked token to the sequence's matcher: None if it was allowed, else why not."""
        m = self._matchers.get(seq_id)
        if m is None or m.consume_token(token):
            return None
        return f"token {token} is outside the request's grammar: {grammar.first_error(m.get_error())}"

    def complete(self, seq_id: int) -> bool:
        """The sequence's grammar takes no more tokens (it is finished)."""
        m = self._matchers.get(seq_id)
        return m is not None and m.is_stopped()

    def book(
        self, seq: Seq, token: int, reason: str | None, finish: Callable[[Seq, str], None]
    ) -> tuple[str | None, str | None]:
        """Feed `seq`'s booked token to its grammar: (its finish reason, None), GRAMMAR_FINISH
        (through `finish`, the scheduler's) when the grammar is complete, also over "length"
        (the output is whole); or (reason, why) when the token is outside the grammar and the
        sequence goes on (the engine fails it alone)."""
        why = self.advance(seq.seq_id, token)
        if why is not None:
            if reason is None:
                return None, why
            self.drop(seq.seq_id)  # it ended on this token anyway
            return reason, None
        if self.complete(seq.seq_id) and reason in (None, "length"):
            if reason is None:
                finish(seq, GRAMMAR_FINISH)
            seq.finish_reason = reason = GRAMMAR_FINISH
        if reason is not None:
            self.drop(seq.seq_id)
        return reason, None


def copies(engine_structured: StructuredOutputs, params: Sequence[SamplingParams]) -> list[object | None]:
    """One matcher per params (None for a free request), each compiled grammar compiled once
    and copied for the other requests that share it; InputError naming the first that fails."""
    out, seen = [], {}
    for i, p in enumerate(params):
        if not p.has_structured_output:
            out.append(None)
            continue
        key = p.structured_outputs
        if key not in seen:
            try:
                seen[key] = engine_structured.compile(p)
            except InputError as exc:
                raise InputError(f"params of prompt {i}: {exc}") from None
            out.append(seen[key])
        else:
            out.append(seen[key].deep_copy())
    return out
