"""The Gluon prefill's key-tile schedule as rendered: the generated module is executed on the CPU
with a stand-in for `gl` (Python ints for the scalar schedule, torch tensors for the token masks),
and its own `_item`, `_schedule`, `_tile_start`, `_hole` and `_softmax`, with the `masked` and hole
expressions read from its consumer loop, run over fuzzed specs, launch shapes and lengths. Every
visible (query, key) pair of every head must get probability mass from exactly one visited tile,
and no invisible pair any (`sparsegen.visible_mask` decides). Gluon itself is not needed.

The schedule's integer operands are never negative, so Python's `//` and `%` agree with the GPU's.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import InputError
from sparsegen.kernels import prefill_gluon_template as tpl
from sparsegen.testing import layer_specs


class _Any:
    """Whatever the module builds at import time for the GPU (layouts, dtypes): ignored."""

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return self


def _tensor(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) for x in xs)


class _Ptr:
    """A pointer into a host list: `cu_seqlens + i` then `gl.load(...)`."""

    def __init__(self, values, at=0):
        self.values, self.at = values, at

    def __add__(self, i):
        return _Ptr(self.values, self.at + int(i))


class _GL:
    constexpr = staticmethod(lambda x: x)
    exp2 = staticmethod(torch.exp2)

    @staticmethod
    def minimum(a, b):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b)) if _tensor(a, b) else min(a, b)

    @staticmethod
    def maximum(a, b):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b)) if _tensor(a, b) else max(a, b)

    @staticmethod
    def where(c, a, b):
        return (
            torch.where(torch.as_tensor(c), torch.as_tensor(a), torch.as_tensor(b))
            if _tensor(c, a, b)
            else (a if c else b)
        )

    @staticmethod
    def max(x, axis):
        return x.amax(axis)

    @staticmethod
    def sum(x, axis):
        return x.sum(axis)

    @staticmethod
    def load(ptr):
        return ptr.values[ptr.at]

    @staticmethod
    def inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
        assert asm == "tanh.approx.f32 $0, $1;", asm  # the soft-cap's one asm op
        return torch.tanh(args[0])

    def __getattr__(self, name):
        return _Any()


def _rendered(layer: LayerSpec, cfg: dict) -> tuple[dict, str]:
    """The rendered module's namespace, executed with the stand-ins, and its source."""
    src = tpl.render_source(layer, "bf16", cfg)
    head = re.search(r"from sparsegen\.kernels\.gluon_api import \((.*?)\)\n", src, re.S)
    assert head, "the rendered module no longer imports from gluon_api as this test expects"
    ns: dict = {name.strip(): _Any() for name in head.group(1).split(",") if name.strip()}
    ns.update(gl=_GL(), jit=lambda fn: fn, __name__="rendered_gluon_prefill")
    exec(compile(src.replace(head.group(0), ""), "<rendered prefill_gluon>", "exec"), ns)
    return ns, src


def _expr(src: str, pattern: str) -> str:
    found = re.findall(pattern, src, re.M)
    assert len(set(found)) == 1, f"expected one form of {pattern!r} in the rendered consumer, got {found}"
    return found[0]


def _check(layer: LayerSpec, cfg: dict, q_lens: list[int], k_lens: list[int]) -> None:
    ns, src = _rendered(layer, cfg)
    vpair, block_m, block_n = cfg["vpair"], cfg["block_m"], cfg["block_n"]
    sinks = any(head.sink_tokens for head in layer.heads)
    # the consumer's own expressions: tile 0, then tile j of the loop
    masked0 = _expr(src, r"^\s*masked = (\(+n_vert == 0\).*)$")
    masked_j = _expr(src, r"^\s*masked = (\(+j >= n_vert\).*)$")
    hole0 = _expr(src, r"^\s*s = _hole\(s, (\(n_vert == 1\).*), offs_n\)$") if vpair else None
    hole_j = _expr(src, r"^\s*s = _hole\(s, (\(j == n_vert - 1\).*), offs_n\)$") if vpair else None
    cu_q, cu_k = [0], [0]
    for nq, nk in zip(q_lens, k_lens, strict=True):
        cu_q.append(cu_q[-1] + nq)
        cu_k.append(cu_k[-1] + nk)
    bh_count = len(q_lens) * layer.num_heads  # as PrefillGluonKernel launches it
    n_q_tiles = -(-max(k_lens) // block_m)
    counted = [torch.zeros(layer.num_heads, nq, nk) for nq, nk in zip(q_lens, k_lens, strict=True)]
    items = set()
    offs_n = torch.arange(block_n)[None, :]
    for i in range(bh_count * n_q_tiles):
        live, h, q_start, q_len, k_start, k_len, m0 = ns["_item"](
            i, bh_count, n_q_tiles, _Ptr(cu_q), _Ptr(cu_k)
        )
        if not live:
            continue
        seq = cu_q.index(q_start) if q_len else next(b for b in range(len(q_lens)) if cu_k[b] == k_start)
        assert (seq, h, m0) not in items, f"work item {(seq, h, m0)} runs twice"
        items.add((seq, h, m0))
        out = ns["_schedule"](q_len, k_len, m0, h)
        path, vo, n_vert, vbase, vstep, tpb, a, b, d, n_tiles = out[:10]
        n_chunks, lo = out[10:12] if vpair else (None, None)
        sk = out[-1] if sinks else None  # sink tokens: the last value
        assert len(out) == 10 + 2 * vpair + sinks, f"_schedule returned {len(out)} values"
        first = k_len - q_len
        rows = (m0 + torch.arange(block_m))[:, None]  # [BLOCK_M, 1] positions
        live_rows = ((rows[:, 0] >= first) & (rows[:, 0] < k_len)).nonzero().flatten()
        names = dict(n_vert=n_vert, b=b, d=d, n_chunks=n_chunks, sk=sk, BLOCK_N=block_n)
        starts_seen = set()
        for j in range(n_tiles):
            if vpair:
                n0, n1 = ns["_tile_start"](j, n_vert, n_chunks, vbase, vstep, tpb, a)
                starts = (n0, n1)
            else:
                n0 = ns["_tile_start"](j, n_vert, vbase, vstep, tpb, a)
                starts = (n0,)
            assert starts not in starts_seen, f"item {(seq, h, m0)} visits key tile {starts} twice"
            starts_seen.add(starts)
            env = dict(names, j=j, n0=n0)
            masked = bool(eval(masked0 if j == 0 else masked_j, {}, env))
            s = torch.zeros(block_m, block_n)
            if vpair:
                s = ns["_hole"](s, bool(eval(hole0 if j == 0 else hole_j, {}, env)), offs_n)
            extra = (lo,) if vpair else ()
            p, *_ = ns["_softmax"](s, torch.full((block_m,), float("-inf")), torch.zeros(block_m), 1.0, masked,
                                   path, rows, n0 + offs_n, vo, *extra)  # fmt: skip
            width = block_n // len(starts)
            for c, start in enumerate(starts):
                part = p[live_rows, c * width : (c + 1) * width]  # [live rows, width]
                keep = min(width, max(0, k_len - start))
                assert start >= 0 and (part[:, keep:] == 0).all() or masked, (
                    f"tile {j} reads past k_len unmasked"
                )
                if keep:
                    counted[seq][h, live_rows + m0 - first, start : start + keep] += part[:, :keep]
    for seq, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True)):
        vis = sparsegen.visible_mask(layer, nq, nk).float()  # [H, nq, nk]
        twice = (counted[seq] > 1).nonzero()
        assert not len(twice), f"seq {seq}: (head, row, key) counted twice: {twice[:5].tolist()}"
        wrong = (counted[seq] != vis).nonzero()
        assert not len(wrong), f"seq {seq}: (head, row, key) {wrong[:5].tolist()} counted {counted[seq][tuple(wrong[0])]:.0f} times, visible {vis[tuple(wrong[0])]:.0f}"  # fmt: skip


OVERRIDES = ({}, {"block_n": 64, "vpair": False}, {"block_n": 128, "vpair": False}, {"kv_major": True},
             {"kv_major": False, "block_m": 128}, {"vpair": True, "block_n": 128})  # fmt: skip


@st.composite
def _cases(draw):
    layer = draw(layer_specs(head_dims=(64,), max_kv_heads=2, gqa_ratios=(1, 2, 4), block_sizes=(64, 128)))
    assume(tpl.covers(layer, "bf16") is None)
    try:
        cfg = tpl.config(layer, **draw(st.sampled_from(OVERRIDES)))
    except InputError:  # vertical blocks narrower than a key chunk: refused by config()
        assume(False)
    k_lens = draw(st.lists(st.integers(1, 600), min_size=1, max_size=2))
    q_lens = [draw(st.integers(1, n)) for n in k_lens]
    return layer, cfg, q_lens, k_lens


@settings(max_examples=30)
@given(_cases())
@example(
    (
        sparsegen.get_pattern("phi3small").layers[0],
        tpl.config(sparsegen.get_pattern("phi3small").layers[0]),
        [700, 64],
        [1100, 64],
    )
)
@example(
    (
        LayerSpec(2, 1, 64, (HeadSpec(block_size=64, sliding_window=5), HeadSpec(block_size=128, local_blocks=1, vert_stride=2, vert_offset=1))),
        tpl.config(LayerSpec(2, 1, 64, (HeadSpec(block_size=64, sliding_window=5), HeadSpec(block_size=128, local_blocks=1, vert_stride=2, vert_offset=1)))),
        [1, 299],
        [257, 300],
    )
)  # fmt: skip
def test_the_rendered_schedule_counts_every_visible_pair_once(case):
    _check(*case)


def test_a_wrong_rendered_schedule_is_caught(monkeypatch):
    """The check fails on a rendered module whose near range starts one tile late."""
    layer = LayerSpec(1, 1, 64, (HeadSpec(block_size=64, local_blocks=3),))
    render = tpl.render_source

    def late(*args, **kwargs):
        src = render(*args, **kwargs)
        assert "    a = lo // BLOCK_N * BLOCK_N\n" in src
        return src.replace("    a = lo // BLOCK_N * BLOCK_N\n", "    a = lo // BLOCK_N * BLOCK_N + BLOCK_N\n")

    monkeypatch.setattr(tpl, "render_source", late)
    try:
        _check(layer, tpl.config(layer), [500], [500])
    except AssertionError as exc:
        assert "counted 0 times, visible 1" in str(exc)
    else:
        raise AssertionError("a schedule that skips a visible tile passed")


@st.composite
def _sink_cases(draw):
    """Layers whose window / local heads carry sink tokens (vertical-stride heads may sit beside
    them, without sinks: covers() sends sinks on a vertical head to the tl kernel)."""
    layer = draw(layer_specs(head_dims=(64,), max_kv_heads=2, gqa_ratios=(1, 2, 4), block_sizes=(64, 128)))
    heads = tuple(
        replace(h, sink_tokens=draw(st.sampled_from((1, 4, 63, 64, 65, 130, 300))))
        if not h.dense and not h.vert_stride and draw(st.booleans())
        else h
        for h in layer.heads
    )
    assume(any(h.sink_tokens for h in heads))
    layer = replace(layer, heads=heads)
    assume(tpl.covers(layer, "bf16") is None)
    try:
        cfg = tpl.config(layer, **draw(st.sampled_from(OVERRIDES)))
    except InputError:
        assume(False)
    k_lens = draw(st.lists(st.integers(1, 700), min_size=1, max_size=2))
    q_lens = [draw(st.integers(1, n)) for n in k_lens]
    return layer, cfg, q_lens, k_lens


_STREAM = LayerSpec(4, 2, 64, (HeadSpec(block_size=64, sliding_window=100, sink_tokens=4),) * 4)
_MIXED = LayerSpec(
    4, 2, 64,
    (HeadSpec(block_size=64, local_blocks=1, sink_tokens=200), HeadSpec(block_size=64, local_blocks=2, vert_stride=3),
     HeadSpec(dense=True), HeadSpec(block_size=64, sliding_window=50, sink_tokens=64)),
)  # fmt: skip


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(_sink_cases())
@example((_STREAM, tpl.config(_STREAM), [600, 5], [600, 700]))
@example((_MIXED, tpl.config(_MIXED), [650], [650]))  # vpair tiles: sink chunks in pairs
@example((_MIXED, tpl.config(_MIXED, block_n=64, vpair=False), [1, 390], [513, 390]))
def test_sink_tiles_count_every_visible_pair_once(case):
    """Sink tokens: the tiles from key 0 below the near range, in the vertical tiles' slots, masked
    past min(sink_tokens, a); each (query, key) counted once, no key tile visited twice."""
    _check(*case)


def test_sink_tiles_fast_cases():
    """Two short sequences through the plain and the vpair schedule with sink tiles (the fuzzed
    test above is marked slow)."""
    _check(_STREAM, tpl.config(_STREAM), [130, 1], [300, 200])
    _check(_MIXED, tpl.config(_MIXED), [280], [280])


@pytest.mark.slow
def test_hd256_tiles_count_every_visible_pair_once():
    """head_dim 256's own tile shape (64-key tiles, no vpair) on sink heads and on vertical ones."""
    sinks = (HeadSpec(block_size=64, sliding_window=90, sink_tokens=7),) * 4
    vert = tuple(HeadSpec(block_size=64, local_blocks=2, vert_stride=4, vert_offset=h % 4) for h in range(4))
    for heads in (sinks, vert):
        layer = LayerSpec(4, 2, 256, heads, logit_softcap=30.0, learned_sinks=True)
        assert tpl.covers(layer, "bf16") is None
        cfg = tpl.config(layer)
        assert (cfg["block_n"], cfg["stages"], cfg["vpair"], cfg["q_smem"]) == (64, 2, False, True)
        _check(layer, cfg, [700, 3], [700, 500])


def test_rendered_softmax_soft_caps_the_scaled_scores():
    """The rendered `_softmax` of a soft-capped layer (tanh stood in by torch.tanh) on raw scores:
    p = exp(c * tanh(scale * s / c) - row max), masked after the cap, in the kernel's log2 units."""
    c, scale = 5.0, 0.3
    layer = LayerSpec(2, 1, 64, (HeadSpec(block_size=64, sliding_window=40),) * 2, logit_softcap=c)
    ns, _ = _rendered(layer, tpl.config(layer))
    block_m, block_n = 128, 128
    s = torch.randn(block_m, block_n, dtype=torch.float64) * 20  # raw q.k, far past the cap
    rows = (200 + torch.arange(block_m))[:, None]
    cols = (180 + torch.arange(block_n))[None, :]
    m0 = torch.full((block_m,), float("-inf"), dtype=torch.float64)
    l0 = torch.zeros(block_m, dtype=torch.float64)
    qk_scale = scale * 1.4426950408889634
    p, m, denom, _ = ns["_softmax"](s, m0, l0, qk_scale, True, 0, rows, cols, 0)
    vis = (cols <= rows) & (rows - cols < 40)
    capped = torch.where(vis, c * torch.tanh(scale * s / c), float("-inf"))  # natural-log units
    want = torch.exp(capped - capped.amax(1, keepdim=True))
    assert torch.allclose(p, want, atol=1e-12), (p - want).abs().max()
    assert torch.allclose(m, capped.amax(1) * 1.4426950408889634) and torch.allclose(denom, want.sum(1))


@pytest.mark.parametrize(
    "old, new",
    [
        ("        n_vert = (sk + BLOCK_N - 1) // BLOCK_N\n", "        n_vert = sk * 0\n"),  # no sink tiles
        ("    seen = seen | (cols < 4)  # sink tokens\n", ""),  # sinks in the near range not seen
        ("(n0 + BLOCK_N > sk)", "(n0 > sk)"),  # a partial sink tile unmasked
    ],
    ids=["no_sink_tiles", "no_sink_mask", "partial_tile_unmasked"],
)
def test_a_wrong_sink_schedule_is_caught(monkeypatch, old, new):
    render = tpl.render_source

    def wrong(*args, **kwargs):
        src = render(*args, **kwargs)
        assert old in src, old
        return src.replace(old, new)

    monkeypatch.setattr(tpl, "render_source", wrong)
    with pytest.raises(AssertionError, match="counted"):
        _check(_STREAM, tpl.config(_STREAM), [130, 1], [300, 200])
