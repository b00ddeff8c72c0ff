"""Continuous batching with chunked prefill over the paged KV cache.

Each step is either a prefill step or a decode step:
- Waiting requests are admitted (in arrival order) while there are seats (`max_num_seqs`) and
  free pages for their whole prompt, plus a page of headroom per running sequence.
- If some running sequence still has more than one uncached token, the step is a prefill:
  chunks of those tokens, at most `max_num_batched_tokens` in all. A chunk is a prefill with
  `q_len < k_len` over the prefix already in the cache.
- Otherwise every running sequence decodes one token.

A decode that needs a new page when none is free preempts the most recently admitted other
sequence (its pages are freed and it is recomputed later). A request that cannot fit in the
whole cache is refused when it is added, so the loop never waits for pages that cannot come.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import InputError
from .kv_cache import CacheOutOfMemory, KVCache, pages_for
from .sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_last_token: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

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


@dataclass(frozen=True)
class Plan:
    is_decode: bool
    chunks: tuple[Chunk, ...]  # decode: one single-token chunk per sequence


class Scheduler:
    def __init__(self, cache: KVCache, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise InputError(
                f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens ({max_num_batched_tokens}) must be >= 1"
            )
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise InputError("a prompt needs at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise InputError(
                f"prompt has {len(prompt_ids)} tokens; the model takes at most {self.max_model_len - 1}"
            )
        most = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        need = pages_for(most, self.cache.page_size)
        if need > self.cache.allocator.capacity:
            raise CacheOutOfMemory(
                f"a request of {len(prompt_ids)} prompt tokens + {params.max_tokens} new tokens needs {need} KV "
                f"pages of {self.cache.page_size} tokens, but the cache has {self.cache.allocator.capacity}; "
                "give the cache more memory or ask for fewer tokens"
            )
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> None:
        alloc, ps = self.cache.allocator, self.cache.page_size
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = pages_for(len(seq), ps) - len(seq.pages)
            if need + len(self.running) > alloc.num_free and self.running:
                break
            seq.pages += alloc.allocate(need)  # alone, it fits: add() checked the whole cache
            self.running.append(self.waiting.popleft())

    def _preempt(self, seq: Sequence) -> None:
        self.cache.allocator.free(seq.pages)
        seq.pages, seq.num_cached = [], 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _grow_for_decode(self, seq: Sequence) -> bool:
        """Give `seq` the page its next token needs; False if `seq` itself was preempted."""
        alloc = self.cache.allocator
        while pages_for(len(seq), self.cache.page_size) > len(seq.pages):
            if alloc.num_free:
                seq.pages += alloc.allocate(1)
                continue
            victims = [s for s in self.running if s is not seq]
            if not victims:
                raise CacheOutOfMemory(
                    f"sequence {seq.seq_id} at {len(seq)} tokens needs another KV page and none is free "
                    f"({alloc.capacity} pages of {self.cache.page_size} tokens in all)"
                )
            self._preempt(victims[-1])
        return True

    def schedule(self) -> Plan | None:
        self._admit()
        if not self.running:
            if self.waiting:  # cannot happen: add() guarantees a lone request fits
                raise CacheOutOfMemory("no request can be admitted into an empty KV cache")
            return None
        budget = self.max_num_batched_tokens
        chunks = []
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                n = min(seq.num_pending, budget)
                chunks.append(Chunk(seq, seq.num_cached, seq.num_cached + n))
                budget -= n
        if chunks:
            return Plan(is_decode=False, chunks=tuple(chunks))
        for seq in list(self.running):
            if seq in self.running:
                self._grow_for_decode(seq)
        chunks = [Chunk(s, len(s) - 1, len(s)) for s in self.running]
        return Plan(is_decode=True, chunks=tuple(chunks))

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.cache.allocator.free(seq.pages)
        seq.pages = []
        self.running.remove(seq)
