"""The engine (paged cache, chunked prefill, continuous batching) against a cache-free oracle.

The oracle is the plain full-recompute forward: every step runs the whole sequence through the
model with `sparsegen.reference` attention and no cache, and takes the argmax. Float32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from sparsegen.engine import CacheOutOfMemory, LLMEngine, SamplingParams
from sparsegen.errors import InputError
from sparsegen.models import ForwardBatch, random_model

NEW_TOKENS = 36

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(123)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (230, 181, 97, 263)]


def full_recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor(ids), ForwardBatch.whole_sequences([len(ids)]))
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def oracle(model, prompts):
    return [full_recompute_greedy(model, p, NEW_TOKENS) for p in prompts]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def test_engine_greedy_equals_full_recompute(model, prompts, oracle):
    engine = LLMEngine(model, max_num_batched_tokens=64, max_num_seqs=3, page_size=16)
    results = engine.generate(prompts, GREEDY)
    for res, want, prompt in zip(results, oracle, prompts, strict=True):
        assert res.prompt_token_ids == prompt
        assert res.token_ids == want
        assert res.finish_reason == "length"
        assert res.metrics.ttft_s >= 0 and res.metrics.decode_tokens_per_s > 0
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity  # every page came back


@pytest.mark.parametrize("chunk", [16, 100])  # 17 / 3 chunks of the tiny model's 272 logits
def test_two_stage_greedy_argmax_in_the_engine_equals_full_recompute(
    monkeypatch, model, prompts, oracle, chunk
):
    """The tiny vocabulary is below the default ARGMAX_CHUNK, so the other engine tests take
    torch.argmax; here the sampler's two-stage argmax picks every greedy token."""
    monkeypatch.setattr("sparsegen.runner.sampling.ARGMAX_CHUNK", chunk)
    engine = LLMEngine(model, max_num_batched_tokens=64, max_num_seqs=3, page_size=16)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == oracle


def test_prompts_are_long_enough_for_sparsity_to_matter(prompts, oracle):
    sparse = random_model("tiny", seed=0)
    dense = random_model("tiny", seed=0, force_dense=True)
    ids = torch.tensor(prompts[0])
    batch = ForwardBatch.whole_sequences([len(ids)])
    diff = (sparse(ids, batch)[-1] - dense(ids, batch)[-1]).abs().max()
    assert diff > 1e-2
    # and the greedy tokens change: the engine/oracle agreement above is sensitive to the pattern
    dense_out = [r.token_ids for r in LLMEngine(dense).generate(prompts, GREEDY)]
    assert sum(d != o for d, o in zip(dense_out, oracle, strict=True)) >= 2


def test_batched_equals_one_at_a_time(model, prompts, oracle):
    alone = [LLMEngine(model, max_num_seqs=1).generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [r.token_ids for r in LLMEngine(model, max_num_seqs=8).generate(prompts, GREEDY)]
    assert alone == batched == oracle


class _LogitsRecorder:
    def __init__(self, engine):
        self.rows: list[torch.Tensor] = []
        forward = engine.runner.run

        def wrapped(plan):
            logits = forward(plan)
            self.rows += list(logits)
            return logits

        engine.runner.run = wrapped


def test_chunked_prefill_equals_whole_prefill(model, prompts):
    whole = LLMEngine(model, max_num_batched_tokens=4096)
    chunked = LLMEngine(model, max_num_batched_tokens=37, page_size=8)  # chunks cross pages and blocks
    rec_w, rec_c = _LogitsRecorder(whole), _LogitsRecorder(chunked)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out_w = whole.generate([prompts[3]], params)[0].token_ids
    out_c = chunked.generate([prompts[3]], params)[0].token_ids
    assert out_w == out_c
    assert len(rec_w.rows) == len(rec_c.rows) == 8
    torch.testing.assert_close(torch.stack(rec_c.rows), torch.stack(rec_w.rows), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["token", "head"])
def test_both_kv_page_layouts_equal_full_recompute(model, prompts, oracle, layout):
    """Head-major pages (the default) and token-major ones, with prefill chunks that read the
    cached prefix back (kv_gather) across pages of 8: the full-recompute tokens either way."""
    engine = LLMEngine(model, max_num_batched_tokens=37, max_num_seqs=2, page_size=8, kv_layout=layout)
    assert engine.cache.layout == layout
    k = engine.cache.k[0]  # [num_pages, page_size, Hkv, D]
    _, ps, hkv, d = k.shape
    want = (hkv * ps * d, d, ps * d, 1) if layout == "head" else (ps * hkv * d, hkv * d, d, 1)
    assert k.stride() == want
    results = engine.generate(prompts[:2], GREEDY)
    assert [r.token_ids for r in results] == oracle[:2]
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


def test_kv_cache_refuses_an_unknown_layout():
    from sparsegen.errors import EngineError
    from sparsegen.runner.kv_cache import KVCache

    with pytest.raises(EngineError, match="layout"):
        KVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                device="cpu", layout="paged")  # fmt: skip


def test_continuous_batching_admits_new_prompts_as_others_finish(model, prompts):
    engine = LLMEngine(model, max_num_seqs=2, max_num_batched_tokens=128)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 12, 5, 4)]
    events = list(engine.stream(prompts, params))
    first_finish = next(i for i, e in enumerate(events) if e.finish_reason is not None)
    first_of_third = next(i for i, e in enumerate(events) if e.index == 2)
    assert first_of_third > first_finish  # prompt 2 waited for a seat
    by_index = {i: [e.token_id for e in events if e.index == i] for i in range(4)}
    assert [len(v) for v in by_index.values()] == [3, 12, 5, 4]
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
    # the engine is reusable, and a late request joins a running batch
    engine.add_request(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), index=10)
    engine.step()
    engine.add_request(prompts[1], SamplingParams(max_tokens=2, ignore_eos=True), index=11)
    done = set()
    while engine.has_unfinished:
        done |= {e.index for e in engine.step() if e.finish_reason}
    assert done == {10, 11}


def test_warmup_leaves_the_engine_as_it_was(model, prompts, oracle):
    engine = LLMEngine(model, max_num_seqs=2, max_num_batched_tokens=128)
    assert engine.warmup() > 0
    assert not engine.has_unfinished
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
    (res,) = engine.generate(prompts[:1], GREEDY)
    assert res.token_ids == oracle[0]


def test_small_cache_preempts_and_still_matches(model, prompts, oracle):
    # 60 usable pages of 16 tokens: not enough for all four sequences at once
    engine = LLMEngine(model, num_pages=61, max_num_seqs=4, max_num_batched_tokens=512)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == oracle
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


def test_request_larger_than_the_cache_is_refused(model):
    engine = LLMEngine(model, num_pages=5)
    with pytest.raises(CacheOutOfMemory, match=r"needs 7 KV pages of 16 tokens, but the cache has 4"):
        engine.add_request(list(range(100)), SamplingParams(max_tokens=5))
    with pytest.raises(InputError, match="at most 4095"):
        LLMEngine(model).add_request([1] * 4096, SamplingParams())
    with pytest.raises(InputError, match="at least one token"):
        LLMEngine(model).add_request([], SamplingParams())
    with pytest.raises(InputError, match=r"prompt token 272 is not an id of the vocabulary 0\.\.271"):
        LLMEngine(model).add_request([1, 272], SamplingParams())


def test_stops_at_eos_stop_tokens_and_max_tokens(model, prompts, oracle):
    want = oracle[1]
    engine = LLMEngine(model)
    engine.eos_token_id = want[4]
    res = engine.generate([prompts[1]], SamplingParams(max_tokens=30))[0]
    assert res.finish_reason == "stop" and res.outputs[0].stop_reason is None  # EOS
    assert res.token_ids == want[: want.index(want[4]) + 1]

    stop = want[6]
    res = LLMEngine(model).generate([prompts[1]], SamplingParams(max_tokens=30, stop_token_ids=(stop,)))[0]
    assert res.finish_reason == "stop" and res.outputs[0].stop_reason == stop
    assert res.token_ids == want[: want.index(stop) + 1]

    res = LLMEngine(model).generate([prompts[1]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert res.finish_reason == "length" and res.token_ids == want[:3]


def test_streaming_and_callback_agree_with_results(model, prompts):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    seen = []
    results = LLMEngine(model).generate(prompts[:2], params, on_token=seen.append)
    streamed = list(LLMEngine(model).stream(prompts[:2], params))
    assert [(e.index, e.token_id) for e in seen] == [(e.index, e.token_id) for e in streamed]
    for i, res in enumerate(results):
        assert [e.token_id for e in streamed if e.index == i] == res.token_ids
        assert [e.finish_reason for e in streamed if e.index == i][-1] == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(model, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=7, ignore_eos=True)
    alone = LLMEngine(model).generate([prompts[0]], params)[0].token_ids
    again = LLMEngine(model).generate([prompts[0]], params)[0].token_ids
    mixed = LLMEngine(model).generate(prompts[:3], [params, GREEDY, params])
    assert alone == again == mixed[0].token_ids
    other = LLMEngine(model).generate([prompts[0]], SamplingParams(**{**params.__dict__, "seed": 8}))[0]
    assert other.token_ids != alone
    top1 = SamplingParams(max_tokens=6, temperature=1.5, top_k=1, seed=1, ignore_eos=True)
    assert (
        LLMEngine(model).generate([prompts[2]], top1)[0].token_ids
        == LLMEngine(model).generate([prompts[2]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    )


def test_page_boundaries_and_one_token_prompts(model):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 16, 32, 33)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    got = [
        r.token_ids
        for r in LLMEngine(model, page_size=16, max_num_batched_tokens=16).generate(prompts, params)
    ]
    assert got == [full_recompute_greedy(model, p, 20) for p in prompts]
