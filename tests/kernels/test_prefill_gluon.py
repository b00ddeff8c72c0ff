"""CPU tier for the Hopper Gluon prefill: its key-tile schedule against the mask, its rendering
and coverage rules, and an ahead-of-time sm_90 build whose PTX must hold async wgmma."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from helpers import extras
from hypothesis import example, given
from hypothesis import strategies as st

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels import gluon_api, gluon_schedule
from sparsegen.kernels import prefill_gluon_template as tpl
from sparsegen.testing import head_specs

extras.require_gluon()


def _check_schedule(head: HeadSpec, q_len: int, k_len: int, block_m: int, block_n: int) -> None:
    layer = LayerSpec(num_heads=1, num_kv_heads=1, head_dim=64, heads=(head,))
    vis = sparsegen.visible_mask(layer, q_len, k_len)[0]  # [q_len, k_len]
    first = k_len - q_len
    seen = torch.zeros_like(vis)
    for m0 in range(0, -(-k_len // block_m) * block_m, block_m):
        rows = slice(max(m0, first) - first, min(m0 + block_m, k_len) - first)
        tiles = gluon_schedule.tiles(head, m0, q_len, k_len, block_m=block_m, block_n=block_n)
        if rows.stop <= rows.start:
            assert tiles == [], (m0, tiles)
            continue
        starts = [n0 for n0, _ in tiles]
        assert len(set(starts)) == len(starts), f"tile loaded twice: {starts}"
        assert tiles, f"live query tile {m0} visits no key tile"
        for n0, masked in tiles:
            assert n0 % block_n == 0 and 0 <= n0 < k_len, (n0, k_len)
            cols = slice(n0, min(n0 + block_n, k_len))
            block = vis[rows, cols]
            assert block.any(), f"tile {n0} of query tile {m0} is loaded but nothing in it is visible"
            if not masked:
                assert block.all() and n0 + block_n <= k_len, (
                    f"unmasked tile {n0} (m0 {m0}) is not fully visible"
                )
            seen[rows, cols] = True
    assert not (vis & ~seen).any(), "a visible pair lies in no visited tile"


@given(
    head=head_specs(),
    k_len=st.integers(1, 900),
    q_frac=st.floats(0.0, 1.0),
    tile=st.sampled_from([(128, 64), (128, 128), (64, 32), (32, 16)]),
)
@example(
    head=HeadSpec(block_size=64, local_blocks=16, vert_stride=8, vert_offset=7),
    k_len=900,
    q_frac=1.0,
    tile=(128, 64),
)
@example(head=HeadSpec(block_size=64, sliding_window=5000), k_len=300, q_frac=0.3, tile=(128, 64))
@example(
    head=HeadSpec(block_size=16, local_blocks=1, vert_stride=3, vert_offset=1),
    k_len=257,
    q_frac=0.5,
    tile=(32, 16),
)
def test_schedule_covers_exactly_the_visible_tiles(head, k_len, q_frac, tile):
    block_m, block_n = tile
    if head.vert_stride and not head.dense and head.block_size % block_n:
        return  # the kernel does not take this spec (covers() sends it to the tl kernel)
    q_len = max(1, round(q_frac * k_len))
    _check_schedule(head, q_len, k_len, block_m, block_n)


def _check_pair_schedule(head: HeadSpec, q_len: int, k_len: int, block_m: int, block_n: int) -> None:
    """vpair: every visible (query, key) pair is counted exactly once, nothing else is counted."""
    layer = LayerSpec(num_heads=1, num_kv_heads=1, head_dim=64, heads=(head,))
    vis = sparsegen.visible_mask(layer, q_len, k_len)[0].int()  # [q_len, k_len]
    first, half = k_len - q_len, block_n // 2
    counted = torch.zeros(q_len, k_len + block_n, dtype=torch.int32)
    for m0 in range(0, -(-k_len // block_m) * block_m, block_m):
        rows = slice(max(m0, first) - first, min(m0 + block_m, k_len) - first)
        found, lo = gluon_schedule.pair_tiles(head, m0, q_len, k_len, block_m=block_m, block_n=block_n)
        if rows.stop <= rows.start:
            assert found == [], (m0, found)
            continue
        assert found, f"live query tile {m0} visits no key tile"
        for n0, n1, masked, hole in found:
            for c0, is_hole in ((n0, False), (n1, hole)):
                # a masked diagonal tile's second chunk may start past k_len (nothing there counts)
                assert c0 % half == 0 and 0 <= c0 < (k_len + half if masked else k_len), (c0, k_len)
                if is_hole or c0 >= k_len:
                    continue
                cols = slice(c0, c0 + half)
                if masked:
                    keep = vis[rows, c0 : min(c0 + half, k_len)].clone()
                    if not head.sink_tokens:  # a sink head's mask is the token mask alone
                        keep[:, : max(0, lo - c0)] = 0  # keys below lo are not counted
                    counted[rows, c0 : c0 + keep.shape[1]] += keep
                else:
                    assert c0 + half <= k_len and vis[rows, cols].all(), (
                        f"unmasked chunk {c0} (m0 {m0}) is not fully visible"
                    )
                    counted[rows, cols] += 1
    counted = counted[:, :k_len]
    assert (counted <= 1).all(), "a (query, key) pair is counted twice"
    assert torch.equal(counted, vis), "a visible pair is not counted"


@given(
    head=head_specs(),
    k_len=st.integers(1, 900),
    q_frac=st.floats(0.0, 1.0),
    tile=st.sampled_from([(128, 128), (128, 64), (64, 32)]),
)
@example(
    head=HeadSpec(block_size=64, local_blocks=16, vert_stride=8, vert_offset=7),
    k_len=900,
    q_frac=1.0,
    tile=(128, 128),
)
@example(head=HeadSpec(block_size=64, local_blocks=3, vert_stride=1), k_len=700, q_frac=0.5, tile=(128, 128))
@example(head=HeadSpec(block_size=128, local_blocks=1, vert_stride=2, vert_offset=1), k_len=899, q_frac=0.2,
         tile=(128, 128))  # fmt: skip
def test_pair_schedule_counts_every_visible_pair_once(head, k_len, q_frac, tile):
    block_m, block_n = tile
    if head.vert_stride and not head.dense and head.block_size % (block_n // 2):
        return  # config() refuses vertical blocks narrower than a chunk
    _check_pair_schedule(head, max(1, round(q_frac * k_len)), k_len, block_m, block_n)


_SINK_HEADS = st.builds(  # a drawn head without its vertical blocks (if any), with sink tokens
    lambda head, n: head if head.dense else replace(head, vert_stride=0, vert_offset=0, sink_tokens=n),
    head_specs(),
    st.sampled_from((1, 4, 63, 64, 65, 129, 300)),
)


@given(
    head=_SINK_HEADS,
    k_len=st.integers(1, 900),
    q_frac=st.floats(0.0, 1.0),
    tile=st.sampled_from([(128, 64), (128, 128), (64, 32)]),
)
@example(
    head=HeadSpec(block_size=64, sliding_window=100, sink_tokens=4), k_len=700, q_frac=1.0, tile=(128, 64)
)
@example(
    head=HeadSpec(block_size=64, local_blocks=1, sink_tokens=200), k_len=900, q_frac=0.5, tile=(128, 128)
)
def test_sink_tiles_cover_exactly_the_visible_tiles(head, k_len, q_frac, tile):
    """Both schedules with sink tokens (heads without vertical blocks: covers() sends the others to tl)."""
    block_m, block_n = tile
    q_len = max(1, round(q_frac * k_len))
    _check_schedule(head, q_len, k_len, block_m, block_n)
    _check_pair_schedule(head, q_len, k_len, block_m, block_n)


def test_schedule_phi3small_long_rows():
    """A 4K sequence: every phi3small head's schedule, with a 1000-token prefix."""
    for head in sparsegen.get_pattern("phi3small").layers[0].heads[:8]:
        _check_schedule(head, 3096, 4096, 128, 64)


def test_covers_and_rejects():
    phi = sparsegen.get_pattern("phi3small")
    assert tpl.covers(phi.layers[0], "bf16") is None and tpl.covers(phi.layers[1], "fp16") is None
    assert "dtype" in tpl.covers(phi.layers[0], "fp32")
    h96 = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=96, heads=(HeadSpec(local_blocks=2),) * 2)
    assert tpl.covers(h96, "bf16") is None  # padded to 128-wide tiles (test_prefill_gluon_hd96.py)
    narrow = LayerSpec(
        num_heads=1,
        num_kv_heads=1,
        head_dim=64,
        heads=(HeadSpec(block_size=32, local_blocks=2, vert_stride=4),),
    )
    assert "narrower" in tpl.covers(narrow, "bf16")
    many = LayerSpec(
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        heads=tuple(HeadSpec(local_blocks=1 + h) for h in range(16)),
    )
    assert "16 distinct head patterns" in tpl.covers(many, "bf16")
    eight = LayerSpec(num_heads=16, num_kv_heads=4, head_dim=64,
                      heads=tuple(HeadSpec(local_blocks=1 + h % 8) for h in range(16)))  # fmt: skip
    assert tpl.covers(eight, "bf16") is None
    local_small = LayerSpec(
        num_heads=1, num_kv_heads=1, head_dim=64, heads=(HeadSpec(block_size=16, local_blocks=3),)
    )
    assert tpl.covers(local_small, "bf16") is None  # no vertical blocks: any block size


def test_rendered_offsets_match_the_spec():
    """The per-head vertical offsets the template computes (affine rule or chain) are the spec's."""
    heads = tuple(
        HeadSpec(block_size=64, local_blocks=2, vert_stride=8, vert_offset=o) for o in (3, 0, 7, 7, 1, 2)
    )
    for layer in (
        sparsegen.get_pattern("phi3small").layers[0],
        LayerSpec(num_heads=6, num_kv_heads=2, head_dim=64, heads=heads),
    ):
        for path in tpl.paths(layer):
            for h, off in path["offsets"]:
                assert off == layer.heads[h].vert_offset
                if path["affine"]:
                    assert (path["off_a"] * h + path["off_c"]) % path["vert"] == off
        src = tpl.render_source(layer, "bf16")
        assert "def prefill_kernel(" in src and "warp_specialize" in src


def test_aot_build_for_sm90_has_async_wgmma_and_setmaxnreg():
    """Built ahead of time on a CPU machine through GluonASTSource; the PTX is kept in the entry."""
    from sparsegen.kernels.prefill_gluon import GluonPrefillKernel

    layer = sparsegen.get_pattern("phi3small").layers[0]
    found = sparsegen.lookup_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90")
    kernel = found.kernel
    assert isinstance(kernel, GluonPrefillKernel) and found.status in ("compiled", "cached")
    assert kernel.arch == "sm_90" and kernel.request.variant == "gluon"
    assert (kernel.path / "prefill_kernel.cubin").stat().st_size > 0
    ptx = kernel.ptx
    assert "wgmma.mma_async" in ptx
    waits = {int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}
    assert any(n >= 1 for n in waits), f"every wgmma is waited on at once: wait_group {sorted(waits)}"
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx), "consumers get no extra registers"
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24", ptx), "the producer keeps its registers"
    assert "cp.async.bulk.tensor" in ptx, "K/V are not loaded by TMA"
    assert "prefill_kernel" in kernel.source and kernel.name == "prefill_gluon_bf16_hd128_h32kv8_bs64_l16_v8"
    assert sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90") is kernel  # memo


def test_default_variant_is_gluon_on_sm90_when_it_covers(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tl kernels below compile for sm_90
    from sparsegen.kernels.base import default_variant

    phi = sparsegen.get_pattern("phi3small")
    many = LayerSpec(num_heads=16, num_kv_heads=4, head_dim=64,
                     heads=tuple(HeadSpec(local_blocks=1 + h) for h in range(16)))  # fmt: skip
    assert default_variant("prefill", "sm_90", phi.layers[0], "bf16") == "gluon"
    assert default_variant("prefill", "sm_90", phi.layers[1], "fp16") == "gluon"
    assert default_variant("prefill", "sm_80", phi.layers[0], "bf16") == "tl"
    assert default_variant("prefill", "sm_90", many, "bf16") == "tl"  # not covered: the tl kernel
    assert default_variant("decode", "sm_90", phi.layers[0], "bf16") == "cuda"
    monkeypatch.setenv("SPARSEGEN_PREFILL_TL", "1")
    assert default_variant("prefill", "sm_90", phi.layers[0], "bf16") == "tl"
    layer = phi.layers[0]
    assert sparsegen.get_kernel(layer, "prefill", dtype=torch.float16, arch="sm_90").request.variant == "tl"
    monkeypatch.setenv("SPARSEGEN_PREFILL_TL", "0")  # the raw value is in the fast memo's key
    assert (
        sparsegen.get_kernel(layer, "prefill", dtype=torch.float16, arch="sm_90").request.variant == "gluon"
    )
    tl = sparsegen.get_kernel(layer, "prefill", dtype=torch.float16, arch="sm_90", variant="tl")
    assert tl.request.variant == "tl" and not tl.name.startswith("prefill_gluon")


@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "single_kv_head", "unaligned_token_stride"])
def test_kv_rows_view_reads_every_head_without_copies(layout):
    """The 2-D [Tk, (Hkv - 1) * stride_h + D] view the TMA descriptor covers maps column g * stride_h + c
    of row t to k[t, g, c]; views into a fused qkv buffer are used in place."""
    from sparsegen.kernels.families.prefill_gluon import _kv_block, _rows

    n, hkv, d, group = 37, 4, 64, 3
    if layout == "fused_qkv":
        k = torch.randn(n, hkv, group + 2, d, dtype=torch.float16)[:, :, -2]  # stride(1) = (group + 2) * d
    elif layout == "single_kv_head":
        hkv = 1
        k = torch.randn(n, 1, 3 * d, dtype=torch.float16)[:, :, d : 2 * d]
    elif layout == "unaligned_token_stride":
        k = torch.randn(n, hkv * d + 3, dtype=torch.float16)[:, : hkv * d].view(n, hkv, d)  # 2-byte-odd rows
    else:
        k = torch.randn(n, hkv, d, dtype=torch.float16)
    rows, s_h = _rows(k, hkv, d)
    for g in range(hkv):
        assert torch.equal(rows[:, g * s_h : g * s_h + d], k[:, g])
    in_place = layout in ("contiguous", "fused_qkv", "single_kv_head")
    assert (rows.data_ptr() == k.data_ptr()) == in_place
    layer = LayerSpec(num_heads=hkv, num_kv_heads=hkv, head_dim=d, heads=(HeadSpec(local_blocks=1),) * hkv)
    block = _kv_block(layer, tpl.config(layer))
    gluon_api.descriptor(rows, block, gluon_api.shared_layout(block, "fp16"))  # TMA's host-side checks pass
