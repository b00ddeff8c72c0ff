"""The batch-1 Triton GEMV (`sparsegen.kernels.linear.gemv`) in Triton's interpreter on a CPU.

Against `F.linear` (and `gegelu(F.linear(...))`) in float64, fp32 and fp16 (the interpreter is
fp16/fp32 only), on shapes that are not multiples of the tiles, with forced tile sizes larger
than the matrix (every mask), plus the model and engine with `triton_gemv=True` against the
plain model. Run by tests/kernels/test_gemv_interpreter.py in a fresh process with TRITON_INTERPRET=1
set before Triton is imported.
"""

from __future__ import annotations

import pytest
import torch

from sparsegen.errors import InputError

pytestmark = pytest.mark.usefixtures("single_thread", "interpreter_env")


def _gemv():
    from sparsegen import ops
    from sparsegen.kernels.linear import gemv

    assert ops.interpreter_usable(), "TRITON_INTERPRET=1 must be set before Triton is imported"
    return gemv


def _case(n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("n,k", [(1, 1), (7, 33), (64, 96), (130, 200), (6, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv_equals_linear(n, k, dtype, with_bias):
    g = _gemv()
    x, w, b = _case(n, k, dtype, seed=n * 1000 + k)
    b = b if with_bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
    got = g.gemv(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype and torch.isfinite(got).all()
    assert rel(got, want) < (1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("n,k", [(2, 5), (64, 96), (130, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_with_gegelu_equals_plain(n, k, dtype):
    from sparsegen.models.phi3small import gegelu

    g = _gemv()
    x, w, b = _case(n, k, dtype, seed=n + k)
    w = w * 8  # push some pre-activations past the limit so the clamps matter
    limit = 3.0
    up = torch.nn.functional.linear(x.float(), w.float(), b.float()).to(dtype)  # rounded as the model's up
    want = gegelu(up.float(), limit)
    got = g.gemv(x, w, b, gegelu_limit=limit)
    assert got.shape == (1, n // 2) and torch.isfinite(got).all()
    assert (up.float().abs() > limit).any()
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("block_n,block_k", [(1, 16), (16, 16), (16, 2048), (4, 64)])
def test_forced_tiles_cover_every_mask(block_n, block_k):
    g = _gemv()
    x, w, b = _case(37, 150, torch.float32, seed=block_n + block_k)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert rel(g.gemv(x, w, b, block_n=block_n, block_k=block_k), want) < 1e-6
    up = torch.nn.functional.linear(x, w[:36], b[:36])
    from sparsegen.models.phi3small import gegelu

    got = g.gemv(x, w[:36], b[:36], gegelu_limit=20.0, block_n=block_n, block_k=block_k)
    assert rel(got, gegelu(up, 20.0)) < 1e-5


@pytest.mark.parametrize("n,k", [(7, 33), (70, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_res", [True, False])
@pytest.mark.parametrize("geg", [False, True])
def test_gemv_with_add_norm_equals_add_norm_then_linear(n, k, dtype, with_res, geg):
    """norm=(residual, w, b, eps): the input is LayerNorm(x + residual), computed per program;
    the sum comes back exactly as `x + residual` rounds (x itself without a residual)."""
    from sparsegen.models.phi3small import gegelu

    g = _gemv()
    x, w, b = _case(n - n % 2 if geg else n, k, dtype, seed=3 * n + k)
    gen = torch.Generator().manual_seed(k)
    res = (4 * torch.randn(1, k, generator=gen)).to(dtype) if with_res else None
    lnw = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    lnb = (0.1 * torch.randn(k, generator=gen)).to(dtype)
    s = x + res if with_res else x
    h = torch.nn.functional.layer_norm(s.float(), (k,), lnw.float(), lnb.float(), 1e-5).to(dtype)
    want = torch.nn.functional.linear(h.float(), w.float(), b.float()).to(dtype)
    if geg:
        want = gegelu(want.float(), 20.0)
    got, summed = g.gemv(x, w, b, gegelu_limit=20.0 if geg else None, norm=(res, lnw, lnb, 1e-5),
                         block_n=8, block_k=64)  # fmt: skip
    assert torch.equal(summed, s) and summed.shape == (1, k)
    assert not with_res or summed.data_ptr() != x.data_ptr()
    assert torch.isfinite(got).all() and rel(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("row_sum", [False, True])
@pytest.mark.parametrize(
    "block_n,block_k", [(2, 64), (4, 16), (8, 128)]
)  # one K tile, several, larger than K
def test_every_kernel_variant_equals_the_plain_path(prefetch, row_sum, block_n, block_k):
    """The W-tile prefetch and per-tile row sums (TUNED_TILES picks them per shape) on every
    path: plain, GeGeLU, and the residual add + LayerNorm before either."""
    from sparsegen.models.layers import gegelu

    g = _gemv()
    x, w, b = _case(38, 64, torch.float32, seed=13)
    res, lnw, lnb = torch.randn(1, 64), 1 + 0.1 * torch.randn(64), 0.1 * torch.randn(64)
    h = torch.nn.functional.layer_norm(x + res, (64,), lnw, lnb, 1e-5)
    tile = dict(block_n=block_n, block_k=block_k, prefetch=prefetch, row_sum=row_sum)
    lin = torch.nn.functional.linear
    assert rel(g.gemv(x, w, b, **tile), lin(x, w, b)) < 1e-6
    assert rel(g.gemv(x, w, b, gegelu_limit=5.0, **tile), gegelu(lin(x, w, b), 5.0)) < 1e-6
    y, summed = g.gemv(x, w, b, norm=(res, lnw, lnb, 1e-5), **tile)
    assert rel(y, lin(h, w, b)) < 1e-5 and torch.equal(summed, x + res)
    y, _ = g.gemv(x, w, b, gegelu_limit=5.0, norm=(res, lnw, lnb, 1e-5), **tile)
    assert rel(y, gegelu(lin(h, w, b), 5.0)) < 1e-5


def test_strided_weight_rows():
    """A weight whose rows are a view with a longer stride (e.g. a slice of columns) is read right."""
    g = _gemv()
    x, w, b = _case(20, 64, torch.float32, seed=5)
    wide = torch.zeros(20, 100)
    wide[:, :64] = w
    view = wide[:, :64]
    assert view.stride() == (100, 1)
    assert rel(g.gemv(x, view, b), torch.nn.functional.linear(x, w, b)) < 1e-6


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda x, w, b: (torch.zeros(2, 8), w, b), "one row"),
        (lambda x, w, b: (torch.zeros(1, 9), w, b), "does not fit"),
        (lambda x, w, b: (x.half(), w, b), "does not fit"),
        (lambda x, w, b: (x, w.t().contiguous().t(), b), "stride"),
        (lambda x, w, b: (x, w, b[:3]), "bias"),
    ],
)
def test_bad_inputs_are_input_errors(bad, match):
    g = _gemv()
    x, w, b = _case(6, 8, torch.float32, seed=0)
    with pytest.raises(InputError, match=match):
        g.gemv(*bad(x, w, b))
    with pytest.raises(InputError, match="even"):
        g.gemv(torch.zeros(1, 8), torch.zeros(5, 8), None, gegelu_limit=1.0)
    ln = torch.ones(8)
    with pytest.raises(InputError, match="norm must be"):
        g.gemv(x, w, b, norm=(None, ln, ln))
    with pytest.raises(InputError, match="ln_weight"):
        g.gemv(x, w, b, norm=(None, torch.ones(7), ln, 1e-5))
    with pytest.raises(InputError, match="residual"):
        g.gemv(x, w, b, norm=(torch.zeros(1, 8, dtype=torch.float16), ln, ln, 1e-5))
    with pytest.raises(InputError, match="weight and bias"):
        g.gemv(x, w, b, norm=(None, None, ln, 1e-5))


def _rope_case(layout, dtype, seed, hkv=2, g=2, d=16, k=40, pages=6, page_size=4):
    gen = torch.Generator().manual_seed(seed)
    n = hkv * (g + 2) * d
    x, w, b = _case(n, k, dtype, seed)
    half = torch.rand(1, d // 2, generator=gen) * 6.0
    theta = torch.cat((half, half), dim=-1)  # [1, D], as Rotary.cos_sin builds it
    cos, sin = theta.cos() * 1.1, theta.sin() * 1.1  # an mscale, as LongRoPE's
    if layout == "head":  # [pages, Hkv, page_size, D] memory seen as [pages, page_size, Hkv, D]
        kc = torch.full((pages, hkv, page_size, d), float("nan"), dtype=dtype).permute(0, 2, 1, 3)
        vc = torch.full((pages, hkv, page_size, d), float("nan"), dtype=dtype).permute(0, 2, 1, 3)
    else:
        kc = torch.full((pages, page_size, hkv, d), float("nan"), dtype=dtype)
        vc = torch.full((pages, page_size, hkv, d), float("nan"), dtype=dtype)
    return x, w, b, cos, sin, kc, vc


@pytest.mark.parametrize("layout", ["token", "head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_gemv_rope_equals_linear_then_rotary_and_cache_write(layout, dtype, with_norm):
    """rope=: the queries equal Rotary.apply over F.linear's (rotated) query rows, k (rotated) and
    v land in the NaN-poisoned caches at the one slot and nowhere else."""
    from sparsegen.models.rope import Rotary

    g_ = _gemv()
    hkv, g, d = 2, 2, 16
    x, w, b, cos, sin, kc, vc = _rope_case(layout, dtype, seed=11)
    slot = torch.tensor([13])  # page 3, offset 1
    norm = None
    h = x
    if with_norm:
        gen = torch.Generator().manual_seed(2)
        res = torch.randn(1, x.shape[1], generator=gen).to(dtype)
        lnw, lnb = (
            (1 + 0.1 * torch.randn(x.shape[1], generator=gen)).to(dtype),
            torch.zeros(x.shape[1], dtype=dtype),
        )
        norm = (res, lnw, lnb, 1e-5)
        h = torch.nn.functional.layer_norm(x + res, (x.shape[1],), lnw, lnb, 1e-5)
    out = g_.gemv(x, w, b, norm=norm, rope=g_.RopeWrite(cos, sin, g, kc, vc, slot))
    q = out[0] if with_norm else out
    qkv = torch.nn.functional.linear(h, w, b).view(1, hkv, g + 2, d)
    want_q = Rotary.apply(qkv[:, :, :g].reshape(1, hkv * g, d), cos, sin)
    want_k = Rotary.apply(qkv[:, :, g], cos, sin)[0]
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert q.shape == (1, hkv * g * d) and rel(q.view(1, hkv * g, d), want_q) < tol
    assert rel(kc[3, 1], want_k) < tol and rel(vc[3, 1], qkv[0, :, g + 1]) < tol
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    written[3, 1] = True
    for cache in (kc, vc):
        assert torch.isnan(cache[~written]).all() and torch.isfinite(cache[written]).all()


def test_gemv_rope_bad_inputs_are_input_errors():
    g_ = _gemv()
    x, w, b, cos, sin, kc, vc = _rope_case("token", torch.float32, seed=1)
    slot = torch.tensor([2])
    rw = g_.RopeWrite
    cases = [
        (dict(rope=rw(cos, sin, 2, kc, vc.transpose(1, 2).contiguous().transpose(1, 2), slot)), "equal"),
        (dict(rope=rw(cos, sin, 3, kc, vc, slot)), "weight rows"),
        (dict(rope=rw(cos, sin, 2, kc, vc, slot.int())), "slot"),
        (dict(rope=rw(cos, sin, 2, kc, vc, torch.tensor([1, 2]))), "slot"),
        (dict(rope=rw(cos[:, :8], sin, 2, kc, vc, slot)), "cos and sin"),
        (dict(rope=rw(cos, sin, 2, kc.half(), vc.half(), slot)), "caches"),
        (dict(rope=rw(cos, sin, 2, kc, vc, slot), gegelu_limit=1.0), "not both"),
    ]
    for kw, match in cases:
        with pytest.raises(InputError, match=match):
            g_.gemv(x, w, b, **kw)
    assert torch.isnan(kc).all() and torch.isnan(vc).all()  # nothing ran


def test_model_and_engine_with_triton_gemv_match_the_plain_model():
    """triton_gemv=True: the batch-1 linear layers (qkv and up_proj with the residual add and
    LayerNorm before them, up_proj with GeGeLU, dense, down_proj, lm_head with the final norm)
    go through the GEMV, at decode steps QKV with the rotary and the cache write; logits and
    greedy tokens equal the cuBLAS-path model's."""
    from sparsegen.engine import LLMEngine, SamplingParams
    from sparsegen.models import ForwardBatch, random_model

    _gemv()
    fast = random_model("tiny", seed=7, triton_gemv=True)
    plain = random_model("tiny", seed=7)
    ids = torch.tensor([5])
    batch = ForwardBatch.whole_sequences([1])
    calls = []
    import sparsegen.kernels.linear.gemv as gm

    real = gm.gemv
    gm.gemv = lambda *a, **kw: (
        calls.append((kw.get("gegelu_limit"), kw.get("norm") is not None)) or real(*a, **kw)
    )
    try:
        got = fast(ids, batch)
    finally:
        gm.gemv = real
    layers = fast.config.num_hidden_layers
    assert len(calls) == 4 * layers + 1 and calls.count((fast.config.gegelu_limit, True)) == layers
    assert sum(norm for _, norm in calls) == 2 * layers + 1  # qkv, up_proj, lm_head: every LayerNorm
    torch.testing.assert_close(got, plain(ids, batch), rtol=1e-5, atol=1e-5)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    ropes = []
    gm.gemv = lambda *a, **kw: ropes.append(kw.get("rope") is not None) or real(*a, **kw)
    try:
        got_ids = LLMEngine(fast).generate([prompt], params)[0].token_ids
    finally:
        gm.gemv = real
    assert got_ids == LLMEngine(plain).generate([prompt], params)[0].token_ids
    # the two decode steps' QKV GEMVs rotated q and k and wrote the cache themselves
    assert sum(ropes) == 2 * layers


def test_tensor_parallel_model_keeps_its_own_layers_under_triton_gemv():
    """A tensor-parallel model (one rank here) with triton_gemv=True: its column-parallel QKV and
    up_proj go through the GEMV, its row-parallel dense/down_proj and vocab-parallel lm_head (which
    communicate) run themselves; logits equal the plain model's."""
    from sparsegen.models import ForwardBatch, named_config, random_model
    from sparsegen.parallel.sharding import TPShard, random_tp_model

    _gemv()
    cfg = named_config("tiny")
    tp = random_tp_model(cfg, TPShard(0, 1), seed=3, triton_gemv=True)
    plain = random_model(cfg, seed=3)
    ids, batch = torch.tensor([9]), ForwardBatch.whole_sequences([1])
    import sparsegen.kernels.linear.gemv as gm

    calls, real = [], gm.gemv
    gm.gemv = lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw)
    try:
        got = tp(ids, batch)
    finally:
        gm.gemv = real
    assert len(calls) == 2 * cfg.num_hidden_layers  # QKV and up_proj of each block, nothing else
    torch.testing.assert_close(got, plain(ids, batch), rtol=1e-5, atol=1e-5)
