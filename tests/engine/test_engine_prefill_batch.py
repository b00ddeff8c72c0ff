"""The prefill batch that `ModelRunner.prepare_prefill` builds with tensor ops equals the one the
per-token Python lists built before (kept below as the oracle): token ids, positions, slots,
cu_seqlens, kv_gather, logits rows, the sampled sequences' tables and the LongRoPE flags, on
shuffled page lists, page boundaries, prompts that are exact multiples of the page size, chunked
prefill continuing a sequence, recomputed sequences (prompt plus output tokens), and batches
mixing all of them. Then the model's last layer on just the sampled rows against the whole one."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.errors import InputError
from sparsegen.models import LongRopeConfig, named_config, random_model
from sparsegen.request.sequence import Chunk, Sequence
from sparsegen.runner.model_runner import token_ids
from sparsegen.runner.transfer import ALIGN, packed_to_device

pytestmark = pytest.mark.usefixtures("single_thread")

LONG_AFTER = 64  # the LongRoPE model's original_max_position_embeddings


@pytest.fixture(scope="module")
def longrope_model():
    cfg = replace(
        named_config("tiny"),
        max_position_embeddings=1024,
        rope_scaling=LongRopeConfig((1.0,) * 32, (1.5,) * 32, LONG_AFTER, 1.0, 1.2),
    )
    return random_model(cfg, seed=0)


def lists_prefill(runner, chunks):
    """The batch as the engine built it with Python lists (before it used tensor ops)."""
    cache = runner.cache
    ids, positions, slots, gather, use_long, last_rows = [], [], [], [], [], []
    cu_q, cu_k = [0], [0]
    has_prefix = any(c.start > 0 for c in chunks)
    ps = cache.page_size
    for c in chunks:
        ids += c.seq.tokens[c.start : c.stop]
        positions += list(range(c.start, c.stop))
        slots += [c.seq.pages[p // ps] * ps + p % ps for p in range(c.start, c.stop)]
        if has_prefix:  # (page, offset in page) of every key
            gather += [(c.seq.pages[p // ps], p % ps) for p in range(0, c.stop)]
        if runner.long_rope_after is not None:
            use_long += runner.use_long_rope(c.seq, c.start, c.stop)
        cu_q.append(cu_q[-1] + c.stop - c.start)
        cu_k.append(cu_k[-1] + c.stop)
        if c.completes:
            last_rows.append(cu_q[-1] - 1)
    sampled = [c for c in chunks if c.completes]
    width = max((len(c.seq.pages) for c in sampled), default=0)
    tables = [c.seq.pages + [cache.scratch_page] * (width - len(c.seq.pages)) for c in sampled]
    t = torch.tensor
    return t(ids, dtype=torch.long), {
        "sampled_block_tables": t(tables, dtype=torch.int32).view(len(sampled), width),
        "sampled_seq_lens": t([c.stop for c in sampled], dtype=torch.int32),
        "positions": t(positions, dtype=torch.long),
        "use_long_rope": t(use_long, dtype=torch.bool) if runner.long_rope_after is not None else None,
        "logits_index": t(last_rows, dtype=torch.long),
        "cu_seqlens_q": t(cu_q, dtype=torch.int32),
        "cu_seqlens_k": t(cu_k, dtype=torch.int32),
        "max_seqlen_q": max(c.stop - c.start for c in chunks),
        "max_seqlen_k": max(c.stop for c in chunks),
        "kv_gather": t(gather, dtype=torch.long).T if has_prefix else None,  # [2, Tk]
        "slot_mapping": t(slots, dtype=torch.long),
    }


def assert_same_batch(runner, chunks):
    ids, batch = runner.prepare_prefill(chunks)
    want_ids, want = lists_prefill(runner, chunks)
    assert ids.dtype == want_ids.dtype and torch.equal(ids, want_ids)
    for name, value in want.items():
        got = getattr(batch, name)
        if value is None or isinstance(value, int):
            assert got == value, name
        else:
            assert got.dtype == value.dtype and torch.equal(got, value), name
    assert batch.is_decode is False


def make_seq(runner, seq_id: int, n_prompt: int, n_out: int, gen: random.Random) -> Sequence:
    """A sequence holding shuffled pages for all its tokens (as after other sequences came and went)."""
    seq = Sequence(seq_id, [gen.randrange(256) for _ in range(n_prompt)], SamplingParams(max_tokens=64))
    seq.output_ids = [gen.randrange(256) for _ in range(n_out)]
    alloc, ps = runner.cache.allocator, runner.cache.page_size
    pages = alloc.allocate(-(-len(seq) // ps))
    gen.shuffle(pages)
    seq.pages = pages
    return seq


def random_chunks(runner, gen: random.Random, first_id: int) -> list[Chunk]:
    """One to four chunks on make_seq's sequences: fresh prompts or continued ones, completing or
    not, some with output tokens."""
    chunks = []
    for j in range(gen.randint(1, 4)):
        seq = make_seq(runner, first_id + j, gen.randint(1, 150), gen.choice([0, 0, gen.randint(1, 20)]), gen)
        start = gen.choice([0, gen.randrange(len(seq))])
        stop = gen.choice([len(seq), gen.randint(start + 1, len(seq))])
        chunks.append(Chunk(seq, start, stop))
    return chunks


def engine_for(model, page_size: int) -> LLMEngine:
    return LLMEngine(model, page_size=page_size, num_pages=400, max_num_seqs=8)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_edge_cases_match_the_per_token_lists(longrope_model, page_size):
    engine = engine_for(longrope_model, page_size)
    runner, gen = engine.runner, random.Random(page_size)
    ps = page_size
    cases = [
        (1, 0, 0, 1),  # one token
        (ps, 0, 0, ps),  # exactly one page
        (3 * ps, 0, 0, 3 * ps),  # an exact multiple of the page size
        (3 * ps + 1, 0, 0, 3 * ps + 1),  # one past a page boundary
        (3 * ps + 1, 0, ps, 2 * ps + 1),  # a chunk continuing from a page boundary, not completing
        (3 * ps + 1, 0, ps - 1 if ps > 1 else 1, 3 * ps + 1),  # a chunk continuing mid-page
        (LONG_AFTER, 0, 0, LONG_AFTER),  # LongRoPE: exactly the original length (short factors)
        (LONG_AFTER + 1, 0, 0, LONG_AFTER + 1),  # one past it: all long
        (40, 50, 0, 90),  # recomputed after a preemption: prompt + output, crossing LONG_AFTER
        (40, 50, 60, 90),  # its last chunk: output tokens only
        (40, 50, 30, 45),  # a chunk across the prompt/output seam
    ]
    for i, (n_prompt, n_out, start, stop) in enumerate(cases):
        seq = make_seq(runner, i, n_prompt, n_out, gen)
        assert_same_batch(runner, [Chunk(seq, start, stop)])
        engine.cache.allocator.free(seq.pages)


def test_random_mixed_batches_match_the_per_token_lists(longrope_model):
    """Batches of up to four chunks: fresh prompts, continued chunks (so kv_gather is built for
    every chunk of the batch), completing or not, prompts with output tokens."""
    for page_size in (4, 16):
        engine = engine_for(longrope_model, page_size)
        runner, gen = engine.runner, random.Random(100 + page_size)
        for trial in range(40):
            chunks = random_chunks(runner, gen, 10 * trial)
            assert_same_batch(runner, chunks)
            for c in chunks:
                engine.cache.allocator.free(c.seq.pages)


def test_without_longrope_there_are_no_flags(model):
    engine = engine_for(model, 16)
    seq = make_seq(engine.runner, 0, 37, 0, random.Random(0))
    assert engine.runner.long_rope_after is None
    assert_same_batch(engine.runner, [Chunk(seq, 0, 37)])
    assert_same_batch(engine.runner, [Chunk(seq, 16, 37)])


def test_long_rope_flags_equal_the_list_choice(longrope_model):
    runner = engine_for(longrope_model, 16).runner
    for n_prompt, start, stop in [
        (1, 0, 1),
        (64, 0, 64),
        (65, 0, 65),
        (10, 60, 70),
        (100, 99, 130),
        (64, 64, 65),
    ]:
        seq = Sequence(0, [1] * n_prompt, SamplingParams())
        want = runner.use_long_rope(seq, start, stop)
        assert runner.long_rope_flags(seq, start, stop).tolist() == want


def test_token_ids_slices_prompt_then_output():
    seq = Sequence(0, [5, 6, 7], SamplingParams())
    seq.output_ids = [8, 9]
    for start in range(5):
        for stop in range(start, 6):
            assert token_ids(seq, start, stop).tolist() == seq.tokens[start:stop]
            assert token_ids(seq, start, stop).dtype == np.int64


def test_packed_parts_are_aligned_views_in_order():
    parts = [np.arange(5), None, np.arange(17) * 3, np.zeros(0, dtype=np.int64), np.array([7])]
    out = packed_to_device(parts, torch.long, torch.device("cpu"))
    assert out[1] is None
    base = out[0].data_ptr()
    for got, want in zip(out, parts, strict=True):
        if want is None:
            continue
        assert got.dtype == torch.long and got.tolist() == want.tolist()
        if want.size:  # (an empty view may report a null data pointer)
            assert (got.data_ptr() - base) % (ALIGN * 8) == 0  # each part as aligned as its own tensor
    flags = packed_to_device([np.array([True, False])], torch.bool, torch.device("cpu"))[0]
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    assert packed_to_device([None, None], torch.long, torch.device("cpu")) == [None, None]


def test_packed_parts_must_be_1d_arrays_of_the_dtype():
    cpu = torch.device("cpu")
    with pytest.raises(InputError, match="1-D int64 arrays, got a ndarray of dtype int32"):
        packed_to_device([np.arange(3), np.arange(3, dtype=np.int32)], torch.long, cpu)
    with pytest.raises(InputError, match=r"shape \(2, 2\)"):
        packed_to_device([np.zeros((2, 2), dtype=np.int64)], torch.long, cpu)
    with pytest.raises(InputError, match="got a Tensor"):
        packed_to_device([torch.arange(3)], torch.long, cpu)


def test_chunked_and_whole_prefill_still_give_the_same_tokens(longrope_model):
    """End to end through the engine: chunks of 16, 48 and the whole prompt agree token for token."""
    prompt = torch.randint(0, 256, (130,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = [
        LLMEngine(longrope_model, page_size=16, max_num_batched_tokens=chunk)
        .generate([prompt], params)[0]
        .token_ids
        for chunk in (16, 48, 8192)
    ]
    assert outs[0] == outs[1] == outs[2]


def test_slots_equal_the_per_position_formula_on_random_tables():
    """KVCache.slots (a broadcast over whole pages, then a slice) against pages[p // ps] * ps + p % ps."""
    from sparsegen.errors import EngineError
    from sparsegen.runner.kv_cache import KVCache

    gen = random.Random(7)
    for ps in (1, 3, 16):
        cache = KVCache(num_layers=1, num_pages=64, page_size=ps, num_kv_heads=1, head_dim=2,
                        dtype=torch.float32, device="cpu")  # fmt: skip
        for _ in range(60):
            n_pages = gen.randint(1, 40)
            pages = gen.sample(range(63), n_pages)
            stop = gen.choice([n_pages * ps, gen.randint(1, n_pages * ps)])
            start = gen.choice([0, stop, gen.randint(0, stop), (stop // ps) * ps])
            got = cache.slots(pages, start, stop)
            want = [pages[p // ps] * ps + p % ps for p in range(start, stop)]
            assert got.dtype == torch.long and got.tolist() == want
        with pytest.raises(EngineError, match="need pages 0..2 of the block table, which has 2"):
            cache.slots([4, 5], 0, 2 * ps + 1)


def fill_cache(runner, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random values in every page (the cached prefixes' keys and values); returns a copy."""
    gen = torch.Generator().manual_seed(seed)
    for k, v in runner.cache.layers:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return [(k.clone(), v.clone()) for k, v in runner.cache.layers]


def restore_cache(runner, saved) -> None:
    for (k, v), (k0, v0) in zip(runner.cache.layers, saved, strict=True):
        k.copy_(k0)
        v.copy_(v0)


@torch.inference_mode()
def test_the_last_layer_on_the_sampled_rows_equals_the_whole_layer(longrope_model):
    """A cached prefill runs its last layer's attention, O projection and MLP on the sampled rows
    only (a decode over the cache just written); logits and every cache write equal the whole
    last layer's (the same batch without its sampled_* tables), on mixed random batches."""
    model = longrope_model
    for page_size in (4, 16):
        engine = engine_for(model, page_size)
        runner, gen = engine.runner, random.Random(200 + page_size)
        for trial in range(12):
            chunks = random_chunks(runner, gen, 10 * trial)
            saved = fill_cache(runner, trial)
            ids, batch = runner.prepare_prefill(chunks)
            want = model(
                ids, replace(batch, sampled_block_tables=None, sampled_seq_lens=None), runner.cache.layers
            )
            want_cache = [(k.clone(), v.clone()) for k, v in runner.cache.layers]
            restore_cache(runner, saved)
            got = model(ids, batch, runner.cache.layers)
            assert got.shape == want.shape == (sum(c.completes for c in chunks), model.config.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for (k, v), (k1, v1) in zip(runner.cache.layers, want_cache, strict=True):
                assert torch.equal(k, k1) and torch.equal(v, v1)
            for c in chunks:
                engine.cache.allocator.free(c.seq.pages)


@torch.inference_mode()
def test_the_last_layer_runs_its_mlp_on_the_sampled_rows_only(model):
    engine = engine_for(model, 16)
    runner, gen = engine.runner, random.Random(9)
    seen: dict[int, list[int]] = {}
    hooks = [
        block.mlp.register_forward_pre_hook(lambda mod, args, i=i: seen.setdefault(i, []).append(args[0].shape[0]))
        for i, block in enumerate(model.model.layers)
    ]  # fmt: skip
    try:
        done, part = make_seq(runner, 0, 40, 0, gen), make_seq(runner, 1, 70, 0, gen)
        last = len(model.model.layers) - 1
        ids, batch = runner.prepare_prefill([Chunk(done, 0, 40), Chunk(part, 0, 30)])
        logits = model(ids, batch, runner.cache.layers)
        assert logits.shape[0] == 1
        assert all(seen[i] == [70] for i in range(last)) and seen[last] == [1]
        seen.clear()
        ids, batch = runner.prepare_prefill([Chunk(part, 30, 50)])  # nothing sampled: K/V only
        assert model(ids, batch, runner.cache.layers).shape == (0, model.config.vocab_size)
        assert all(seen[i] == [20] for i in range(last)) and last not in seen
    finally:
        for h in hooks:
            h.remove()


@torch.inference_mode()
def test_sampled_tables_that_disagree_with_the_logits_rows_are_refused_before_any_write(model):
    engine = engine_for(model, 16)
    runner, gen = engine.runner, random.Random(11)
    a, b = make_seq(runner, 0, 33, 0, gen), make_seq(runner, 1, 20, 0, gen)
    ids, batch = runner.prepare_prefill([Chunk(a, 0, 33), Chunk(b, 0, 20)])
    saved = fill_cache(runner, 0)
    bad = [
        (dict(sampled_seq_lens=batch.sampled_seq_lens[:1]), "2 logits rows, 1 sampled_seq_lens and 2"),
        (dict(sampled_block_tables=batch.sampled_block_tables[:1]), "2 sampled_seq_lens and 1 sampled_block"),
        (dict(sampled_block_tables=None), r"must be \[R, pages\].*got \[None, \(2,\)\]"),
        (dict(sampled_seq_lens=batch.sampled_seq_lens.view(2, 1)), r"got \[\(2, 3\), \(2, 1\)\]"),
        (dict(sampled_block_tables=batch.sampled_block_tables.long()), "must be int32, got torch.int64"),
        (dict(sampled_seq_lens=batch.sampled_seq_lens.float()), "torch.float32"),
        (dict(sampled_seq_lens=None), r"got \[\(2, 3\), None\]"),  # one table without the other
        (dict(slot_mapping=None), "must write the KV cache: slot_mapping is None"),
    ]
    for fields, match in bad:
        with pytest.raises(InputError, match=match):
            model(ids, replace(batch, **fields), runner.cache.layers)
        for (k, v), (k0, v0) in zip(runner.cache.layers, saved, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.gpu
def test_prefill_batch_on_the_gpu_equals_the_lists_and_its_views_are_aligned():
    """On a GPU the batch comes from pinned buffers in non-blocking copies, as views: the same
    values as the lists, every field's pointer 16-byte aligned (kernels specialised on it), and
    the host buffers safe to drop before the copies run (the caching host allocator holds them)."""
    cfg = replace(
        named_config("tiny"),
        max_position_embeddings=1024,
        rope_scaling=LongRopeConfig((1.0,) * 32, (1.5,) * 32, LONG_AFTER, 1.0, 1.2),
    )
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    engine = LLMEngine(model, page_size=16, num_pages=400, max_num_seqs=8, use_cuda_graphs=False)
    runner, gen = engine.runner, random.Random(5)
    for trial in range(20):
        seqs = [
            make_seq(runner, 10 * trial + j, gen.randint(1, 150), gen.choice([0, 7]), gen) for j in range(3)
        ]
        chunks = [Chunk(s, gen.choice([0, gen.randrange(len(s))]), len(s)) for s in seqs]
        torch.cuda._sleep(1_000_000)  # keep the stream busy: the copies are queued behind it
        ids, batch = runner.prepare_prefill(chunks)
        want_ids, want = lists_prefill(runner, chunks)
        assert torch.equal(ids.cpu(), want_ids)
        for name, value in want.items():
            got = getattr(batch, name)
            if isinstance(got, torch.Tensor):
                assert got.device.type == "cuda" and got.data_ptr() % 16 == 0, name
                assert torch.equal(got.cpu(), value), name
            else:
                assert got == value, name
        for s in seqs:
            engine.cache.allocator.free(s.pages)
