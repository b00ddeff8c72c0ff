"""GPU tier for `kernels.linear.gemm_rows` (`pytest -m gpu`, sm_90): the few-row CUDA linear layer
against the float64 product, on seeded random shapes, rows and tiles, into NaN-filled outputs."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from sparsegen.errors import InputError
from sparsegen.kernels.linear import gemm_rows as gr
from sparsegen.kernels.linear.gemm_rows_tiles import TUNED_TILES, Tile
from sparsegen.runner.graph_capture import capture

pytestmark = pytest.mark.gpu
TOL = 1e-2  # one bf16 / fp16 rounding of each output (~4e-3), float32 sums


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("gemm_rows needs an sm_90 GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _cases():
    rng = random.Random(7)
    out = []
    for (n, k), tile in TUNED_TILES.items():  # the 7b shapes with their tiles
        out.append((n, k, tile, rng.choice((2, 17, 32)), torch.bfloat16, True))
    while len(out) < len(TUNED_TILES) + 16:  # small shapes, random tiles that divide them
        split, resident = rng.choice((1, 2, 4, 8)), len(out) % 2 == 1
        rpw = 32 if resident else rng.choice((16, 32))
        tile = Tile(32 * rng.randint(1, 4), 64 * rng.randint(1, 4), split, rng.randint(2, 5), resident, rpw)
        n = tile.block_n * rng.randint(1, 6)
        k = tile.block_k * split * rng.randint(1, 5)
        try:
            tile.check(n, k)
        except InputError:  # too much shared memory for this draw
            continue
        out.append(
            (n, k, tile, rng.randint(1, 32), rng.choice((torch.bfloat16, torch.float16)), rng.random() < 0.7)
        )
    return out


@pytest.mark.parametrize("n,k,tile,rows,dtype,has_bias", _cases())
def test_matches_float64(n, k, tile, rows, dtype, has_bias):
    _hopper()
    g = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g) if has_bias else None
    wide = torch.randn(rows, k + 64, device="cuda", dtype=dtype, generator=g)
    x = wide[:, 32 : 32 + k]  # a row stride above K, 64-byte offset start
    ref = x.double() @ w.double().T + (b.double() if has_bias else 0)
    y = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    gr.gemm_rows(x, w, b, tile=tile, out=y)
    assert not y.isnan().any()
    assert _rel(y, ref) < TOL
    # as close to the float64 product as cuBLAS is (both round each output once)
    assert _rel(y, ref) < 2 * _rel(F.linear(x, w, b), ref) + 1e-3
    again = gr.gemm_rows(x, w, b, tile=tile, pdl=False)
    assert torch.equal(again, y)  # the cluster sums in rank order: bitwise repeatable


def test_in_a_cuda_graph_with_pdl():
    _hopper()
    n, k = 4096, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    eager = gr.gemm_rows(x, w, b)
    chain_in = torch.zeros(32, k, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with capture(graph):
        chain_in.copy_(x)  # the kernel before: its writes must be seen after griddepcontrol.wait
        y = gr.gemm_rows(chain_in, w, b, pdl=True)
        y2 = gr.gemm_rows(y, w, b, pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    assert torch.equal(y2, gr.gemm_rows(eager, w, b))


def test_bad_inputs_are_refused_before_launch():
    _hopper()
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match="rows"):
        gr.gemm_rows(torch.randn(33, 512, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(InputError, match="must match"):
        gr.gemm_rows(x.half(), w)
    with pytest.raises(InputError, match="columns"):
        gr.gemm_rows(x, torch.randn(256, 448, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(InputError, match="unit column stride"):
        gr.gemm_rows(x, w.t().contiguous().t())
    with pytest.raises(InputError, match="bias"):
        gr.gemm_rows(x, w, torch.randn(255, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(InputError, match="does not divide"):
        gr.gemm_rows(x, w, tile=Tile(96, 64, 1, 3))
    with pytest.raises(InputError, match="out must be"):
        gr.gemm_rows(x, w, out=torch.empty(4, 255, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "tile", [TUNED_TILES[(28672, 4096)], Tile(64, 128, 2, 3), Tile(64, 128, 4, 3, x_resident=True)]
)
@pytest.mark.parametrize("rows", [2, 32])
def test_gegelu_epilogue_matches_the_plain_path(tile, rows):
    """gegelu_limit: the (gate, linear) pairs of each output row go through GeGeLU in the kernel,
    after the same rounding the plain `layers.gegelu(F.linear(...))` applies."""
    _hopper()
    from sparsegen.models.layers import gegelu

    n, k, limit = (28672, 4096, 20.0) if tile.block_n == 224 else (512, 1024, 1.5)
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.25  # some pairs clamp
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    lin = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)  # one rounding, as F.linear's
    ref = gegelu(lin.double(), limit)
    assert (lin.double()[:, 0::2] > limit).any() and (lin.double()[:, 1::2].abs() > limit).any()
    y = torch.full((rows, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    gr.gemm_rows(x, w, b, tile=tile, gegelu_limit=limit, out=y)
    assert not y.isnan().any()
    assert _rel(y, ref) < TOL
    plain = gegelu(F.linear(x, w, b), limit)
    assert _rel(y, ref) < 2 * _rel(plain, ref) + 1e-3
    with pytest.raises(InputError, match="gegelu_limit"):
        gr.gemm_rows(x, w, b, tile=tile, gegelu_limit=0.0)


@pytest.mark.parametrize(
    "hkv,group,d,k,tile,rows",
    [
        (8, 4, 128, 4096, Tile(128, 64, 4, 4, rows_per_warp=16), 32),
        (8, 4, 128, 4096, Tile(128, 128, 2, 4, rows_per_warp=16), 5),
        (2, 2, 64, 512, Tile(128, 64, 2, 3), 17),
        (2, 2, 64, 512, Tile(128, 128, 1, 2, x_resident=True), 3),
    ],
)
def test_rope_epilogue_matches_rotary_qkv(hkv, group, d, k, tile, rows):
    """rope=: q rotated as rotary.rotary_qkv rotates F.linear's output, k and v written at each
    token's slot of head-major caches and nowhere else (the rest stays NaN)."""
    _hopper()
    from sparsegen.kernels.fused import rotary
    from sparsegen.kernels.linear.rope_write import RopeWrite

    n = hkv * (group + 2) * d
    gen = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    theta = torch.rand(rows, d, device="cuda", generator=gen) * 6.28
    cos, sin = theta.cos(), theta.sin()
    pages, page_size = 3 * rows, 16
    slots = torch.randperm(pages * page_size, device="cuda", generator=gen)[:rows]

    def caches():
        return tuple(
            torch.full(
                (pages, hkv, page_size, d), float("nan"), device="cuda", dtype=torch.bfloat16
            ).transpose(1, 2)
            for _ in range(2)
        )

    kc, vc = caches()
    q = gr.gemm_rows(x, w, b, tile=tile, rope=RopeWrite(cos, sin, group, kc, vc, slots))
    rk, rv = caches()
    qkv = F.linear(x, w, b).view(rows, hkv, group + 2, d)
    rq, _, _ = rotary.rotary_qkv(qkv, cos, sin, (rk, rv), slots)
    assert q.shape == (rows, hkv * group * d)
    assert not q.isnan().any()
    assert _rel(q, rq.reshape(rows, -1).double()) < TOL
    written = torch.zeros(pages * page_size, dtype=torch.bool, device="cuda")
    written[slots] = True  # slot = page * page_size + offset: the [pages, page_size] view, flattened
    for got, ref in ((kc, rk), (vc, rv)):
        got_t, ref_t = got.reshape(pages * page_size, hkv, d), ref.reshape(pages * page_size, hkv, d)
        assert got_t[~written].isnan().all()  # nothing outside the tokens' slots was written
        assert not got_t[written].isnan().any()
        assert _rel(got_t[written], ref_t[written].double()) < TOL
