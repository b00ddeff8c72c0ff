"""Continuous batching with chunked prefill over the paged KV cache.

Each step is either a prefill step or a decode step:
- Waiting requests are admitted (in arrival order) while there are seats (`max_num_seqs`) and
  free pages for their whole prompt, plus a page of headroom per running sequence.
- If some running sequence still has more than one uncached token, the step is a prefill:
  chunks of those tokens, at most `max_num_batched_tokens` in all. A chunk is a prefill with
  `q_len < k_len` over the prefix already in the cache. The chunks of requests that ask for
  prompt_logprobs hold at most `SCORED_STEP_TOKENS` tokens a step between them: each of their
  rows has a row of logits over the vocabulary.
- Otherwise every running sequence decodes one token.

With prefix caching, admission first looks up the sequence's full pages by their chained
hashes (`engine.prefix_cache`): the longest run found becomes its first pages (shared, by
reference count) and its cached length starts after them, leaving at least one token to
compute so that the last row is sampled. A request that asks for prompt_logprobs skips the
lookup: it computes its whole prompt, since every prompt position's logits score a prompt token
(its pages are registered all the same, for later requests). A page is registered under its hash once it is full
and its K/V are booked (`postprocess`); a released registered page stays cached until the
allocator evicts it for lack of empty pages (`runner.page_pool`).

A decode that needs a new page when none is free preempts the most recently admitted other
sequence (its pages are freed and it is recomputed later). A request that cannot fit in the
whole cache is refused when it is added, so the loop never waits for pages that cannot come.

After the forward pass and sampling, `postprocess(plan, tokens, now)` books the step: cached
lengths, new tokens, timings, finish reasons, and the pages of finished sequences.
"""

from __future__ import annotations

import time
from collections import deque

from ..errors import InputError
from ..request.sequence import Chunk, Plan, Sequence
from ..runner.kv_cache import CacheOutOfMemory, KVCache, pages_for
from .prefix_cache import PrefixCounters, extend_page_hashes, root_digest

__all__ = ["SCORED_STEP_TOKENS", "Chunk", "Plan", "Scheduler", "Sequence"]

# Prompt tokens a step computes of the requests that ask for prompt_logprobs, all of them
# together: their float32 logits are [tokens, vocab] (for Phi-3-Small's 100,352-token vocabulary,
# 1024 rows are 392 MiB, and their log-softmax as much again).
SCORED_STEP_TOKENS = 1024


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_id: int | None = None,
        prefix_caching: bool = False,
        cache_salt: bytes = b"",
        long_rope_after: int | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise InputError(
                f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens ({max_num_batched_tokens}) must be >= 1"
            )
        self.cache = cache
        self.eos_token_id = eos_token_id
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_caching = prefix_caching
        self.long_rope_after = long_rope_after  # prompts longer than this use LongRoPE's long factors
        self._roots = {flag: root_digest(cache_salt, flag) for flag in (False, True)}
        self.prefix_counters = PrefixCounters()

    def check(self, prompt_len: int, max_tokens: int, where: str = "prompt") -> None:
        """Raise if a request of this size could never run (too long, or the whole cache is too small)."""
        if prompt_len >= self.max_model_len:
            raise InputError(
                f"{where} has {prompt_len} tokens; the model takes at most {self.max_model_len - 1}"
            )
        most = min(prompt_len + max_tokens, self.max_model_len)
        need = pages_for(most, self.cache.page_size)
        if need > self.cache.allocator.capacity:
            raise CacheOutOfMemory(
                f"{where}: a request of {prompt_len} prompt tokens + {max_tokens} new tokens needs {need} KV "
                f"pages of {self.cache.page_size} tokens, but the cache has {self.cache.allocator.capacity}; "
                "give the cache more memory or ask for fewer tokens"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a sequence that `check` accepted."""
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """Drop `seq` wherever it is and free its pages; False if it had already finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        self.cache.allocator.free(seq.pages)
        seq.pages, seq.finish_reason, seq.num_registered = [], "abort", 0
        return True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        limit = self.long_rope_after
        root = self._roots[limit is not None and len(seq.prompt_ids) > limit]
        return extend_page_hashes(seq, num_pages, self.cache.page_size, root)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered pages that hold `seq`'s longest cached run of full pages, short of its
        last token (which is always computed, so that its logits exist)."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        most = (len(seq) - 1) // self.cache.page_size
        return self.cache.allocator.lookup(self._hashes(seq, most)[:most]) if most else []

    def _admit(self) -> None:
        alloc, ps = self.cache.allocator, self.cache.page_size
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._cached_prefix(seq)
            need = pages_for(len(seq), ps) - len(hit)
            revived = sum(alloc.refcount(p) == 0 for p in hit)  # cached pages leave the free count
            if need + revived + len(self.running) > alloc.num_free and self.running:
                break
            alloc.share(hit)  # before allocate, which could otherwise evict them
            seq.pages += hit
            seq.pages += alloc.allocate(need)  # alone, it fits: add() checked the whole cache
            seq.num_cached = seq.num_registered = len(hit)
            seq.num_cached *= ps
            if seq.num_cached_tokens is None:  # its first admission (not a preempted one's return)
                seq.num_cached_tokens = seq.num_cached
                seq.t_scheduled = time.perf_counter()
            if self.prefix_caching and seq.params.prompt_logprobs is None:  # the others skip the lookup
                self.prefix_counters.queries += len(seq)
                self.prefix_counters.hits += seq.num_cached
            self.running.append(self.waiting.popleft())

    def _register(self, seq: Sequence) -> None:
        """Register `seq`'s pages that became full with booked K/V."""
        full = seq.num_cached // self.cache.page_size
        if not self.prefix_caching or full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered, full):
            self.cache.allocator.register(seq.pages[i], hashes[i])
        seq.num_registered = full

    def _preempt(self, seq: Sequence) -> None:
        self.cache.allocator.free(seq.pages)
        seq.pages, seq.num_cached, seq.num_registered = [], 0, 0
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
        budget, scored = self.max_num_batched_tokens, SCORED_STEP_TOKENS
        chunks = []
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                n = min(seq.num_pending, budget)
                if seq.params.prompt_logprobs is not None:
                    n = min(n, scored)
                    if n == 0:  # this step's scored rows are taken: the next step computes it
                        continue
                    scored -= n
                chunks.append(Chunk(seq, seq.num_cached, seq.num_cached + n))
                budget -= n
        if chunks:
            return Plan(is_decode=False, chunks=tuple(chunks))
        for seq in list(self.running):
            if seq in self.running:
                self._grow_for_decode(seq)
        chunks = [Chunk(s, len(s) - 1, len(s)) for s in self.running]
        return Plan(is_decode=True, chunks=tuple(chunks))

    def schedule_lookahead(self, inflight: Plan) -> Plan | None:
        """The decode step after the decode step `inflight`, planned before its tokens reach the
        host: the same sequences in the same order, one position further (each has one token in
        flight, so its next input sits at position len(seq)). Only the token values are unknown,
        and positions, slots, pages and block tables do not depend on them.

        Returns None where that plan could differ from what `schedule()` would make once the
        tokens are booked, and the caller then completes `inflight` and schedules as usual:
        - the running sequences are not exactly `inflight`'s (one finished, was aborted or
          preempted since);
        - a waiting request could be admitted (a seat is free);
        - a sequence ends at `inflight` whatever its token (max_tokens or max_model_len);
        - the pages for the next position are not all free (`schedule()` would preempt).
        A sequence that ends at `inflight` on its token's value (EOS, a stop token) is still in
        the plan returned: its row of the lookahead step is computed and discarded.
        """
        seqs = [c.seq for c in inflight.chunks]
        if not inflight.is_decode or len(seqs) != len(self.running):
            return None
        if any(a is not b for a, b in zip(seqs, self.running, strict=True)):
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        for s in seqs:
            if len(s.output_ids) + 1 >= s.params.max_tokens or len(s) + 1 >= self.max_model_len:
                return None
        ps, alloc = self.cache.page_size, self.cache.allocator
        grow = [max(0, pages_for(len(s) + 1, ps) - len(s.pages)) for s in seqs]
        if sum(grow) > alloc.num_free:
            return None
        for s, n in zip(seqs, grow, strict=True):
            if n > 0:
                s.pages += alloc.allocate(n)
        chunks = tuple(Chunk(s, len(s), len(s) + 1) for s in seqs)
        return Plan(is_decode=True, chunks=chunks, lookahead=True)

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` ends with its newest `token`, or None if it goes on."""
        p = seq.params
        if token == self.eos_token_id and not p.ignore_eos:
            return "eos"
        if token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def postprocess(self, plan: Plan, tokens: list[int], now: float) -> list[str | None]:
        """Book one step: every chunk's tokens are now in the cache; each sampled sequence
        (`plan.sampled`, in order) gets its new token from `tokens` and its timings; those that
        finish free their pages. Returns the finish reason (or None) per sampled sequence."""
        for c in plan.chunks:
            c.seq.num_cached = c.stop
            self._register(c.seq)
        reasons = []
        for seq, token in zip(plan.sampled, tokens, strict=True):
            seq.output_ids.append(token)
            if seq.t_first_token is None:
                seq.t_first_token = now
            seq.t_last_token = now
            reason = self.finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
            reasons.append(reason)
        return reasons

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.cache.allocator.free(seq.pages)
        seq.pages, seq.num_registered = [], 0
        self.running.remove(seq)
