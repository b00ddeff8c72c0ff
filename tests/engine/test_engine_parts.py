"""Engine parts on their own: page allocator, sampler, and the CUDA-graph bookkeeping on CPU."""

from __future__ import annotations

import pytest
import torch
from helpers.graphs import stand_in_graphs

from sparsegen.engine import CacheOutOfMemory, LLMEngine, PageAllocator, SamplingParams
from sparsegen.errors import InputError
from sparsegen.models import ForwardBatch, random_model
from sparsegen.runner.cuda_graphs import DecodeGraphs, width_bucket
from sparsegen.runner.sampling import filter_logits, sample

pytestmark = pytest.mark.usefixtures("single_thread")


def test_page_allocator_hands_out_and_takes_back():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(CacheOutOfMemory, match="asked for 2 KV pages but only 1 of 4 are free"):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 4


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, 3, 1.0)) == [0, 1, 2]
    assert kept(filter_logits(logits, 0, 0.7)) == [0, 1]  # 0.5 < 0.7 <= 0.8
    assert kept(filter_logits(logits, 0, 0.4)) == [0]
    assert kept(filter_logits(logits[[3, 2, 1, 0]], 0, 0.95)) == [1, 2, 3]  # order does not matter
    assert kept(filter_logits(logits, 2, 0.9)) == [0, 1]


def test_sample_greedy_and_seeded():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    hot = SamplingParams(temperature=1.0, seed=5)
    hist = [[]] * 3
    assert sample(logits, [greedy] * 3, hist).token_ids == logits.argmax(-1).tolist()
    assert sample(logits, [hot] * 3, hist).token_ids == sample(logits, [hot] * 3, hist).token_ids


@pytest.mark.parametrize(
    "kwargs,field",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"stop_token_ids": "abc"}, "stop_token_ids"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)  # fmt: skip
def test_sampling_params_are_validated(kwargs, field):
    with pytest.raises(InputError, match=field):
        SamplingParams(**kwargs)


def test_width_bucket():
    assert [width_bucket(p, 8192) for p in (1, 64, 65, 513, 9000)] == [64, 64, 128, 1024, 8192]
    assert width_bucket(100, 80) == 80


def test_a_capture_runs_the_forward_with_the_collector_off(monkeypatch, model):
    """DecodeGraphs._capture: the warm-up forward runs with gc on, the captured one with gc off
    (a collection mid-capture could free an old engine's graphs, which CUDA forbids then); torch's
    CUDA stream and graph calls are stood in for on this CPU machine."""
    import contextlib
    import gc

    engine = LLMEngine(model, page_size=16, num_pages=64, max_num_seqs=2)
    graphs = DecodeGraphs(model, engine.cache, 2, engine.max_model_len)
    seen = []

    class FakeGraph:
        def pool(self):
            return None

    class FakeStream:
        def wait_stream(self, other):
            pass

    def forward(ids, batch, layers):
        seen.append(gc.isenabled())
        return torch.zeros(ids.shape[0], 4)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    graphs.forward = forward
    graphs._capture(1, 64)
    assert seen == [True, False] and gc.isenabled()


def _longrope_tiny():
    from dataclasses import replace

    from sparsegen.models import LongRopeConfig, named_config

    return replace(
        named_config("tiny"),
        max_position_embeddings=512,
        rope_scaling=LongRopeConfig((1.0,) * 32, tuple(1.0 + i / 8 for i in range(32)), 64, 1.0, 1.3),
    )


@pytest.mark.parametrize("longrope", [False, True])
def test_graph_bookkeeping_on_cpu_matches_eager(longrope):
    """Static buffers, padding rows into the scratch page and width buckets, without a GPU
    (with LongRoPE, the per-row factor flags too: prompts of 40 and 75 tokens cross 64)."""
    model = random_model(_longrope_tiny() if longrope else "tiny", seed=0)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 75, 130)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager = [r.token_ids for r in LLMEngine(model, max_num_seqs=4).generate(prompts, params)]

    engine = LLMEngine(model, max_num_seqs=4)
    graphs = stand_in_graphs(model, engine, 4)
    graphed = [r.token_ids for r in engine.generate(prompts, params)]
    assert graphed == eager
    assert {b for b, _ in graphs.graphs} <= {1, 2, 4} and {w for _, w in graphs.graphs} == {
        min(64, graphs.max_pages)
    }
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


def test_graph_bookkeeping_with_preemption_and_uneven_finishes():
    """Graph replays (CPU stand-in) while sequences finish at different steps, the batch shrinks
    and a 7-page cache preempts: rows change hands and preempted tables are replaced, so the
    kept host block tables must be rewritten exactly then. Tokens equal an eager engine's."""
    model = random_model("tiny", seed=0)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (15, 7, 15)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 5, 9)]
    kw = dict(max_num_seqs=3, num_pages=8, page_size=8)
    eager = [r.token_ids for r in LLMEngine(model, **kw).generate(prompts, params)]

    engine = LLMEngine(model, **kw)
    graphs = stand_in_graphs(model, engine, 3)
    tables_seen = []

    run = graphs.run

    def checked_run(inputs, input_ids=None):
        out = run(inputs, input_ids)
        b = next(size for size in graphs.sizes if size >= len(inputs.pages))  # rows this replay reads
        want = torch.full_like(graphs.host_tables, engine.cache.scratch_page)
        for i, pages in enumerate(inputs.pages):
            want[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        assert torch.equal(graphs.host_tables[:b], want[:b])
        tables_seen.append(tuple(k[0] for k in inputs.keys))
        return out

    graphs.run = checked_run
    preempted = []
    grow = engine.scheduler._preempt

    def preempt(seq):
        preempted.append(seq.seq_id)
        grow(seq)

    engine.scheduler._preempt = preempt
    graphed = [r.token_ids for r in engine.generate(prompts, params)]
    assert graphed == eager
    assert preempted, "the cache was meant to run out of pages"
    assert len({len(t) for t in tables_seen}) >= 2  # the batch shrank
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


def test_kept_host_tables_follow_growth_reuse_and_replaced_tables():
    """`DecodeGraphs` keeps the host block tables across steps. Fuzzed steps: rows change
    sequences, tables grow, a sequence comes back to its old row with a replaced table (a new
    page_epoch, possibly shorter), the batch shrinks and grows. After each step the rows a replay
    reads equal tables built from scratch."""
    import random

    from sparsegen.runner.decode_inputs import DecodeInputs

    model = random_model("tiny", seed=0)
    engine = LLMEngine(model, max_num_seqs=6, num_pages=64, page_size=8)
    graphs = DecodeGraphs(model, engine.cache, 6, engine.max_model_len)
    scratch, rng = engine.cache.scratch_page, random.Random(0)
    tables = {}  # seq_id -> (epoch, pages)
    replaced = 0
    for step in range(300):
        ids = rng.sample(range(8), rng.randint(1, 6)) if step % 7 == 0 or not tables else list(tables)[:6]
        for sid in ids:
            epoch, pages = tables.get(sid, (0, []))
            roll = rng.random()
            if roll < 0.1 and pages:
                epoch, pages, replaced = (
                    epoch + 1,
                    [rng.randrange(63) for _ in range(rng.randint(1, 4))],
                    replaced + 1,
                )
            elif roll < 0.5 or not pages:
                pages = pages + [rng.randrange(63) for _ in range(rng.randint(1, 2))]
            tables[sid] = (epoch, pages)
        rows = [tables[sid] for sid in ids]
        inputs = DecodeInputs(ids=[0] * len(ids), positions=[0] * len(ids), slots=[0] * len(ids),
                              seq_lens=[1] * len(ids), pages=[p for _, p in rows],
                              keys=[(sid, tables[sid][0]) for sid in ids], width=max(len(p) for _, p in rows),
                              scratch=scratch, use_long=None)  # fmt: skip
        b = next(size for size in graphs.sizes if size >= len(ids))
        graphs._update_host_tables(inputs, b)
        want = torch.full((b, graphs.max_pages), scratch, dtype=torch.int32)
        for i, (_, pages) in enumerate(rows):
            want[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        assert torch.equal(graphs.host_tables[:b], want), step
    assert replaced > 10


def test_sequence_page_epoch_counts_replaced_tables_only():
    from sparsegen.request.sequence import Sequence

    seq = Sequence(0, [1, 2, 3], SamplingParams())
    assert seq.page_epoch == 0 and seq.last_token == 3
    seq.pages += [4, 5]  # grown in place (the list itself is assigned back)
    seq.pages.append(6)
    assert seq.page_epoch == 0
    seq.pages = []  # preempted or finished: another list
    assert seq.page_epoch == 1
    seq.output_ids.append(9)
    assert seq.last_token == 9 and seq.tokens[-1] == 9


def test_longrope_choice_is_chunk_invariant():
    from dataclasses import replace

    from sparsegen.models import LongRopeConfig, named_config

    tiny = named_config("tiny")
    cfg = replace(
        tiny,
        max_position_embeddings=512,
        rope_scaling=LongRopeConfig((1.0,) * 32, tuple(1.0 + i / 8 for i in range(32)), 64, 1.0, 1.3),
    )
    model = random_model(cfg, seed=1)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    whole = LLMEngine(model).generate([prompt], params)[0].token_ids
    chunked = LLMEngine(model, max_num_batched_tokens=30).generate([prompt], params)[0].token_ids
    assert whole == chunked
    # the prompt (100 > 64 original positions) runs entirely on the long factors, as HF does
    logits = model(torch.tensor(prompt), ForwardBatch.whole_sequences([100]))
    batch = ForwardBatch.whole_sequences([100])
    batch.use_long_rope = torch.ones(100, dtype=torch.bool)
    assert int(model(torch.tensor(prompt), batch)[-1].argmax()) == whole[0]
    assert not torch.equal(logits[-1], model(torch.tensor(prompt), batch)[-1])


def _host_timeline():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "host_timeline.py"
    spec = importlib.util.spec_from_file_location("host_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("host_timeline", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_host_timeline_instruments_an_engine_and_puts_it_back(model):
    """benchmarks/engine/host_timeline.instrumented marks one prefill's stages, then leaves the engine's
    methods and the model's hooks as they were (the next call is not timed)."""
    ht = _host_timeline()
    engine = LLMEngine(model, max_num_seqs=2)
    tl = ht.Timeline(cuda=False)
    with ht.instrumented(engine, tl):
        tl.mark("start")
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1, ignore_eos=True))
        tl.mark("returned")
    stages = [m.stage.split(" (")[0] for m in tl.marks]
    assert stages == ["start", "submitted", "scheduled", "batch built", "forward start", "forward launched",
                      "sampler launched", "token on host", "booked", "returned"]  # fmt: skip
    for obj, name in ((engine, "submit"), (engine, "_launch"), (engine.scheduler, "schedule"),
                      (engine.scheduler, "postprocess"), (engine.runner, "run"),
                      (engine.runner, "prepare_prefill")):  # fmt: skip
        assert name not in vars(obj)
    assert not model._forward_pre_hooks
    engine.generate([[4, 5]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert len(tl.marks) == 10
    summary = ht.summary(tl.rows())
    assert summary["forwards"] == 1 and summary["gpu_forwards_ms"] is None
    assert summary["total_host_ms"] >= summary["host_before_first_forward_ms"] > 0
