"""Automatic prefix caching in the engine: the same greedy tokens with caching on and off, on
prompts that share prefixes (in one step, across steps, chunked, preempted), the page
accounting after every step, LRU eviction, and the hit counts. Tiny random model, float32 CPU."""

from __future__ import annotations

import random

import pytest
import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.request.sequence import Sequence

pytestmark = pytest.mark.usefixtures("single_thread")

PS = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = ids(70, 1)  # 4 full pages and 6 tokens
PROMPTS = [SYSTEM + ids(n, 10 + n) for n in (9, 30, 17)]


def checked(engine: LLMEngine) -> None:
    held = [s.pages for s in engine.scheduler.running]
    engine.cache.allocator.check(held)
    assert not any(s.pages for s in engine.scheduler.waiting)


def run(engine: LLMEngine, prompts, params=GREEDY) -> dict[int, list[int]]:
    """Submit, step to the end with the accounting checked after every step; tokens per index."""
    seqs = engine.submit(prompts, params)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished:
        for e in engine.step():
            out[e.index].append(e.token_id)
        checked(engine)
        steps += 1
        assert steps < 2000
    alloc = engine.cache.allocator
    assert alloc.num_free == alloc.capacity and alloc.num_referenced == 0
    assert all(s.finish_reason == "length" for s in seqs)
    return out


def engine_of(model, caching: bool, **kw) -> LLMEngine:
    kw.setdefault("page_size", PS)
    return LLMEngine(model, enable_prefix_caching=caching, **kw)


@pytest.mark.parametrize("chunk", [24, 4096])
def test_greedy_tokens_are_the_same_with_caching_on_and_off(model, chunk):
    off = engine_of(model, False, max_num_batched_tokens=chunk)
    want = run(off, PROMPTS)
    assert off.cache.allocator.num_cached == 0
    on = engine_of(model, True, max_num_batched_tokens=chunk)
    assert run(on, PROMPTS) == want  # one step: no prefix is booked yet when they are admitted
    first = on.scheduler.prefix_counters.hits
    assert run(on, PROMPTS) == want  # across steps: the system prompt and more come from the cache
    assert on.scheduler.prefix_counters.hits - first >= 3 * 4 * PS
    assert on.cache.allocator.num_cached > 0
    # a new suffix after the cached system prompt, admitted while others run
    later = [SYSTEM + ids(40, 99), PROMPTS[1] + ids(5, 98)]
    assert run(on, later) == run(off, later)


def test_cached_tokens_per_request_and_the_stats(model):
    engine = engine_of(model, True)
    first = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    again = engine.generate([PROMPTS[0], SYSTEM + ids(3, 5), ids(50, 6)], GREEDY)
    assert [r.num_cached_tokens for r in again] == [4 * PS, 4 * PS, 0]
    assert again[0].token_ids == first.token_ids
    c = engine.scheduler.prefix_counters
    assert c.queries == 2 * len(PROMPTS[0]) + 73 + 50 and c.hits == 8 * PS
    from sparsegen.engine.stats import engine_stats

    stats = engine_stats(engine)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (c.queries, c.hits)
    assert stats.kv_pages_cached == engine.cache.allocator.num_cached > 0 and stats.kv_pages_used == 0


def test_a_fully_cached_prompt_still_computes_its_last_token(model):
    prompt = ids(2 * PS, 3)  # exactly two full pages
    off = engine_of(model, False).generate([prompt], GREEDY)[0]
    engine = engine_of(model, True)
    engine.generate([prompt], GREEDY)
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == PS  # the last page holds the token whose logits are needed
    assert again.token_ids == off.token_ids
    one_more = engine.generate([prompt + [7]], GREEDY)[0]  # 2 pages + 1: both pages hit
    assert one_more.num_cached_tokens == 2 * PS
    assert one_more.token_ids == engine_of(model, False).generate([prompt + [7]], GREEDY)[0].token_ids


def test_equal_pages_after_different_prefixes_do_not_hit(model):
    tail = ids(2 * PS, 4)
    engine = engine_of(model, True)
    engine.generate([ids(PS, 5) + tail + [1]], GREEDY)
    other = engine.generate([ids(PS, 6) + tail + [1]], GREEDY)[0]
    assert other.num_cached_tokens == 0


def count_preemptions(engine: LLMEngine) -> list[int]:
    hits = []
    preempt = engine.scheduler._preempt

    def counted(seq):
        hits.append(seq.seq_id)
        preempt(seq)

    engine.scheduler._preempt = counted
    return hits


@pytest.mark.parametrize("async_decode", [False, True])
def test_preemption_under_a_tiny_cache_keeps_the_tokens(model, async_decode):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [SYSTEM + ids(10, 20 + i) for i in range(3)]
    kw = dict(num_pages=15, max_num_seqs=3, max_num_batched_tokens=32, async_decode=async_decode)
    off = engine_of(model, False, **kw)
    off_preempted = count_preemptions(off)
    want = run(off, prompts, params)
    on = engine_of(model, True, **kw)
    preempted = count_preemptions(on)
    run(on, [prompts[0]], SamplingParams(max_tokens=2, ignore_eos=True))  # the system prompt cached
    hits_before = on.scheduler.prefix_counters.hits
    assert run(on, prompts, params) == want
    assert off_preempted and preempted  # the cache is too small for all three at once
    assert on.scheduler.prefix_counters.hits - hits_before > 3 * 4 * PS  # resumed ones hit too


def test_lru_eviction_under_a_small_cache_keeps_the_recent_prefix(model):
    engine = engine_of(model, True, num_pages=13)  # 12 usable pages
    a, b = ids(4 * PS + 1, 30), ids(4 * PS + 1, 31)
    short = SamplingParams(max_tokens=1)
    engine.generate([a], short)
    engine.generate([b], short)  # 4 full pages each are cached (the 65th token's page is not)
    assert engine.cache.allocator.num_cached == 8 and engine.cache.allocator.num_empty == 4
    engine.generate([a], short)  # a's pages are now the most recent
    engine.generate([ids(6 * PS, 32)], short)  # 6 pages: 4 empty, then 2 evicted from b (the oldest)
    probe = lambda prompt: len(  # noqa: E731
        engine.cache.allocator.lookup(engine.scheduler._hashes(Sequence(-1, prompt, short), 4))
    )
    assert (probe(a), probe(b)) == (4, 2)  # b lost its two deepest pages
    hit_a = engine.generate([a], short)[0].num_cached_tokens
    hit_b = engine.generate([b], short)[0].num_cached_tokens
    assert hit_a == 4 * PS and hit_b < 4 * PS
    engine.cache.allocator.check([])


def test_random_workload_keeps_the_accounting_and_the_tokens(model):
    rng = random.Random(11)
    roots = [ids(rng.randint(20, 60), 40 + i) for i in range(3)]
    prompts = [rng.choice(roots) + ids(rng.randint(1, 30), 60 + i) for i in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    kw = dict(num_pages=20, max_num_seqs=4, max_num_batched_tokens=40)
    want = run(engine_of(model, False, **kw), prompts, params)
    engine = engine_of(model, True, **kw)
    assert run(engine, prompts[:5], params[:5]) == {i: want[i] for i in range(5)}
    # the rest, submitted one per step while others run, with an abort among them
    out: dict[int, list[int]] = {}
    pending = list(range(5, 10))
    live = {}
    steps = 0
    while pending or engine.has_unfinished:
        if pending:
            i = pending.pop(0)
            live[i] = engine.add_request(prompts[i], params[i], index=i)
        if steps == 3:
            engine.abort(live[7].seq_id) if 7 in live else None
        for e in engine.step():
            out.setdefault(e.index, []).append(e.token_id)
        checked(engine)
        steps += 1
    for i in range(5, 10):
        if live[i].finish_reason != "abort":
            assert out[i] == want[i]
    assert engine.cache.allocator.num_referenced == 0 and engine.scheduler.prefix_counters.hits > 0


def test_llm_takes_the_flag_and_n_completions_agree(model):
    from sparsegen import LLM

    llm = LLM(random="tiny", enable_prefix_caching=True)
    assert llm.engine.config.enable_prefix_caching
    text = "a shared system prompt that spans more than one page of sixteen tokens. "
    sp = SamplingParams(max_tokens=6, n=2, temperature=0.0)
    first = llm.generate([text + "one"], sp, use_tqdm=False)[0]
    again = llm.generate([text + "two"], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= PS
    assert len({tuple(c.token_ids) for c in first.outputs}) == 1  # greedy: both completions equal
    off = LLM(random="tiny", enable_prefix_caching=False)
    assert off.generate([text + "two"], sp, use_tqdm=False)[0].outputs[0].token_ids == again.token_ids
