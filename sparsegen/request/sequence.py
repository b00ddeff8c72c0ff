"""What the scheduler moves around: a `Sequence` (one request's tokens, pages and timings), a
`Chunk` of it that one forward pass computes, and the `Plan` of one step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams, TokenLogprobs


@dataclass(eq=False)
class Sequence:
    """One request. The engine builds it (after checking its prompt and parameters); the
    scheduler owns its pages and its bookkeeping (`Scheduler.postprocess`)."""

    seq_id: int  # the request id that `LLMEngine.abort` takes
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # block table: page ids in position order
    num_cached: int = 0  # tokens whose K/V are in the cache
    # Prefix caching: tokens found in the cache at the sequence's first admission (None before
    # it), the chained hashes of its full pages computed so far (engine.prefix_cache), and how
    # many of its first pages are registered (or were shared) under them.
    num_cached_tokens: int | None = None
    page_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_registered: int = 0
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "abort"
    # SamplingParams.prompt_logprobs: one entry per prompt token booked so far, the first None
    # (the engine fills it from each prefill chunk's logits; None when the request did not ask)
    prompt_logprobs: list[TokenLogprobs | None] | None = field(default=None, repr=False)
    t_submit: float = field(default_factory=time.perf_counter)
    t_scheduled: float | None = None  # when it was first admitted to the running batch
    t_first_token: float | None = None
    t_last_token: float | None = None
    # Bumped whenever `pages` is replaced by another list (a preemption or a finish empties it):
    # pages are otherwise only appended, so (seq_id, page_epoch) names a block table that may
    # only have grown since. The CUDA graphs' host table rewrites only the new tail of a row.
    page_epoch: int = field(default=0, init=False)

    def __setattr__(self, name: str, value) -> None:
        if name == "pages" and "pages" in self.__dict__ and value is not self.__dict__["pages"]:
            object.__setattr__(self, "page_epoch", self.page_epoch + 1)
        object.__setattr__(self, name, value)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """tokens[-1] without building the whole list (a decode step reads it for every row)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return len(self) - self.num_cached


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first position of the chunk (= tokens already cached)
    stop: int  # one past its last position

    @property
    def completes(self) -> bool:
        """The chunk reaches the end of the sequence, so its last row is sampled."""
        return self.stop == len(self.seq)

    @property
    def scored_positions(self) -> range:
        """The chunk's positions whose logits score the next prompt token (position p scores
        prompt token p + 1), when its sequence asked for prompt_logprobs; else empty."""
        if self.seq.params.prompt_logprobs is None:
            return range(0)
        return range(self.start, min(self.stop, len(self.seq.prompt_ids) - 1))


@dataclass(frozen=True)
class Plan:
    is_decode: bool
    chunks: tuple[Chunk, ...]  # decode: one single-token chunk per sequence
    # A decode step planned while the previous decode step of the same sequences is still in
    # flight (`Scheduler.schedule_lookahead`): each chunk is (len(seq), len(seq) + 1) at planning
    # time, its input token is the one that step is sampling, not yet on the host.
    lookahead: bool = False
    # Decode only: the input token ids on the model's device, [len(chunks)] int64, when they are
    # not on the host (a lookahead step: the previous step's sampled tokens). None: each
    # sequence's last token.
    input_ids: torch.Tensor | None = field(default=None, compare=False)
    # Grammar masks of the sampled rows whose requests are constrained, [len(sampled), W] int32 on
    # the host (runner.token_mask); None when no sampled row is.
    token_bitmask: torch.Tensor | None = field(default=None, compare=False)

    @property
    def scores_prompt(self) -> bool:
        """Some chunk of this prefill step computes prompt log-probabilities."""
        return not self.is_decode and any(c.scored_positions for c in self.chunks)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences whose last row this step samples, in the order of the logits rows: every
        row of a decode step, the chunks of a prefill that reach the end of their sequence."""
        if self.is_decode:
            return [c.seq for c in self.chunks]
        return [c.seq for c in self.chunks if c.completes]
