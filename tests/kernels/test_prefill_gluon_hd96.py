"""CPU tier for head_dim 96 in the Gluon (sm_90) prefill: 128-wide tiles, K/V through 3-D TMA
descriptors whose zero fill pads each head's row, Q and O through masked loads and stores. Covers
the render (64 and 128 pinned byte for byte), the ahead-of-time sm_90 build and its PTX, and the
host-side views, descriptors and launch arguments (everything short of running it on a GPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import extras
from helpers.gluon_render_cases import digests

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels import gluon_api
from sparsegen.kernels import prefill_gluon_template as tpl

extras.require_gluon()
GOLDEN = Path(__file__).parent / "golden" / "prefill_gluon_render_sha256.json"
PHI = sparsegen.get_pattern("phi3small").layers[0]
PHI96 = LayerSpec(num_heads=32, num_kv_heads=8, head_dim=96, heads=PHI.heads)  # vertical: vpair tiles
WIN96 = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=96, heads=(HeadSpec(sliding_window=300),) * 4)


def test_head_dims_64_and_128_render_as_before():
    """608 (spec, config, dtype) cases at head_dim 64/128, hashed before head_dim 96 was added."""
    want = json.loads(GOLDEN.read_text())
    got = digests()
    assert got.keys() == want.keys()
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} rendered sources changed, e.g. {changed[:3]}"


def test_hd96_is_covered_and_picked_on_sm90():
    from sparsegen.kernels.base import default_variant

    for layer in (PHI96, WIN96):
        assert tpl.covers(layer, "bf16") is None and tpl.covers(layer, "fp16") is None
        assert default_variant("prefill", "sm_90", layer, "bf16") == "gluon"
        assert default_variant("prefill", "sm_80", layer, "bf16") == "tl"
    assert [tpl.tile_dim(d) for d in (64, 96, 128)] == [64, 128, 128]
    assert tpl.plan(PHI96, "bf16")["tile_d"] == 128 and tpl.plan(PHI, "bf16")["tile_d"] == 128


@pytest.mark.parametrize("layer", [PHI96, WIN96], ids=["vpair", "plain"])
def test_hd96_source_pads_to_128(layer):
    src = tpl.render_source(layer, "bf16")
    assert "HEAD_DIM = gl.constexpr(128)" in src and "HEAD_D = gl.constexpr(96)" in src
    assert "head_dim 96" in src.splitlines()[3]  # the header names the real head_dim
    # K/V: the 3-D descriptors' coordinates (token, KV head, column 0) into a [keys, 1, 128] view of
    # the 2-D ring tile; never a column offset into a neighbouring head.
    assert "col_k" not in src and "stride_kh *" not in src and "* stride_kh" not in src
    n_loads = 4 if tpl.config(layer)["vpair"] else 2
    assert len(re.findall(r"tma_load\([kv]_desc, \[k_start \+ n[01], kv, 0\]", src)) == n_loads
    assert src.count(".reshape([BLOCK_N, 1, HEAD_DIM])") == n_loads
    assert "allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], KV_SHARED)" in src
    # Q and O: columns >= 96 masked (Q loads zeros there, O leaves them unwritten).
    assert "io_mask = io_ok[:, None] & (io_d < HEAD_D)[None, :]" in src
    assert "gl.load(q_ptrs, mask=io_mask, other=0.0)" in src and "gl.store(o_ptrs, out, mask=io_mask)" in src
    assert f"TILE_BYTES = gl.constexpr({tpl.config(layer)['block_n'] * 128 * 2})" in src
    src128 = tpl.render_source(LayerSpec(4, 2, 128, layer.heads[:4]), "bf16")
    assert "HEAD_D " not in src128 and "reshape" not in src128 and "io_mask" not in src128


@pytest.mark.parametrize(
    "layer, dtype, box", [(PHI96, torch.bfloat16, 64), (WIN96, torch.float16, 128)], ids=["vpair", "plain"]
)
def test_hd96_aot_build_for_sm90(layer, dtype, box):
    """Built ahead of time through the lifecycle; async wgmma, setmaxnreg, rank-3 TMA. Triton splits
    a 128-column box of a 128-byte swizzle into 64-column messages: the second starts at column 64
    of a 96-column last dim, so TMA zero-fills its columns 96..127 (tensordesc_meta is the box the
    host encodes)."""
    from sparsegen.kernels.prefill_gluon import GluonPrefillKernel

    found = sparsegen.lookup_kernel(layer, "prefill", dtype=dtype, arch="sm_90")
    kernel = found.kernel
    assert isinstance(kernel, GluonPrefillKernel) and kernel.request.variant == "gluon"
    assert kernel.name.startswith(f"prefill_gluon_{kernel.request.dtype}_hd96_")
    ptx = kernel.ptx
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.{kind}\.{kind}", ptx)  # 128 wide
    waits = {int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}
    assert any(n >= 1 for n in waits), f"every wgmma is waited on at once: wait_group {sorted(waits)}"
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx), "consumers get no extra registers"
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24", ptx), "the producer keeps its registers"
    assert "cp.async.bulk.tensor.3d" in ptx and "cp.async.bulk.tensor.2d" not in ptx
    meta = json.loads((kernel.path / "prefill_kernel.json").read_text())
    boxes = [m["block_size"] for m in meta["tensordesc_meta"]]
    assert boxes == [[box, 1, 64]] * 2, boxes


def _kv(layout: str, n: int, hkv: int, d: int = 96) -> torch.Tensor:
    """k [n, hkv, d] in one of several memory layouts."""
    if layout == "fused_qkv":  # [n, hkv, group + 2, d]: stride(1) = (group + 2) * d
        return torch.randn(n, hkv, 5, d, dtype=torch.float16)[:, :, -2]
    if layout == "single_kv_head":
        return torch.randn(n, 1, 3 * d, dtype=torch.float16)[:, :, d : 2 * d]
    if layout == "unaligned_token_stride":  # 2-byte-odd rows: TMA-illegal, copied
        return torch.randn(n, hkv * d + 3, dtype=torch.float16)[:, : hkv * d].view(n, hkv, d)
    if layout == "head_major":  # [hkv, n, d] transposed: strides not outer-to-inner, copied
        return torch.randn(hkv, n, d, dtype=torch.float16).transpose(0, 1)
    if layout == "unaligned_base":
        return torch.randn(n * hkv * d + 1, dtype=torch.float16)[1:].view(n, hkv, d)
    if layout == "one_token_odd_stride":  # torch calls it contiguous (size-1 dim), TMA would not
        return torch.empty_strided((1, hkv, d), (7, d, 1), dtype=torch.float16).normal_()
    return torch.randn(n, hkv, d, dtype=torch.float16)


@pytest.mark.parametrize(
    "layout",
    [
        "contiguous",
        "fused_qkv",
        "single_kv_head",
        "unaligned_token_stride",
        "head_major",
        "unaligned_base",
        "one_token_odd_stride",
    ],
)
def test_hd96_heads_view_and_descriptor(layout):
    """The 3-D view a head_dim-96 descriptor covers is k itself (or a copy where TMA needs one): its
    last dim is exactly 96, so a 128-wide box ends in zero fill, not in the next head."""
    from sparsegen.kernels.families.prefill_gluon import _heads, _kv_block

    n, hkv = 37, 1 if layout == "single_kv_head" else 4
    k = _kv(layout, n, hkv)
    n = k.shape[0]
    view, s_h = _heads(k, hkv, 96)
    assert view.shape == (n, hkv, 96) and torch.equal(view, k)
    assert view.stride(2) == 1 and view.stride(1) == s_h and s_h >= 96
    assert all(s * 2 % 16 == 0 for s in view.stride()[:2]) and view.data_ptr() % 16 == 0
    assert view.stride(0) >= hkv * s_h  # heads never overlap, tokens outermost
    in_place = layout in ("contiguous", "fused_qkv", "single_kv_head")
    assert (view.data_ptr() == k.data_ptr()) == in_place
    layer = LayerSpec(num_heads=hkv, num_kv_heads=hkv, head_dim=96, heads=(HeadSpec(local_blocks=1),) * hkv)
    block = _kv_block(layer, tpl.config(layer))
    assert block == [128, 1, 128]
    layout_3d = gluon_api.shared_layout(block, "fp16")
    assert layout_3d.rank == 3 and layout_3d.swizzle_byte_width == 128
    desc = gluon_api.descriptor(view, block, layout_3d)  # TMA's host-side checks pass
    assert list(desc.shape) == [n, hkv, 96] and list(desc.strides) == list(view.stride())


class _Entry:
    """Stands in for the loaded CompiledKernel: `entry[grid]` is what Launch calls."""

    def __getitem__(self, grid):
        return ("launcher", grid)


def _prepared(layer: LayerSpec, k: torch.Tensor, v: torch.Tensor, n_q: int, cu_q, cu_k):
    from sparsegen.kernels.base import KernelRequest
    from sparsegen.kernels.prefill_gluon import GluonPrefillKernel

    request = KernelRequest.make("prefill", layer, dtype=torch.float16, arch="sm_90", variant="gluon")
    cfg = tpl.config(layer)
    kernel = GluonPrefillKernel(request, "key", "name", Path("."), "", cfg, _Entry())
    q = torch.randn(n_q, layer.num_heads, layer.head_dim, dtype=torch.float16)
    return q, kernel.prepare(q, k, v, cu_q, cu_k, 0.1)


def test_hd96_launch_arguments(monkeypatch):
    """prepare() for head_dim 96 without a GPU: 3-D descriptors over k and v themselves (a fused
    qkv view in place), boxes [keys, 1, 128], the head strides, the grid, a NaN-poisoned output."""
    from sparsegen.kernels.prefill_gluon import ARG_NAMES, LOG2E, signature

    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")
    n, hkv = 300, 8
    qkv = torch.randn(n, hkv, 6, 96, dtype=torch.float16)  # per KV group: 4 q heads, k, v
    k, v = qkv[:, :, 4], qkv[:, :, 5]  # [n, 8, 96], stride(1) = 6 * 96
    cu_q = torch.tensor([0, 100, 250], dtype=torch.int32)
    cu_k = torch.tensor([0, 120, n], dtype=torch.int32)
    q, launch = _prepared(PHI96, k, v, 250, cu_q, cu_k)
    args = dict(zip(ARG_NAMES, launch.args))
    assert launch.out.shape == q.shape and launch.out.isnan().all()
    for name, t in (("k_desc", k), ("v_desc", v)):
        desc = args[name]
        assert desc.base.data_ptr() == t.data_ptr()  # read in place
        assert list(desc.shape) == [n, hkv, 96] and list(desc.strides) == [hkv * 6 * 96, 6 * 96, 1]
        assert list(desc.block_shape) == [64, 1, 128] and desc.layout.rank == 3
        assert desc.padding == "zero"  # out-of-bounds columns (96..127) read as 0
    assert args["stride_kh"] == args["stride_vh"] == 6 * 96
    assert args["qk_scale"] == pytest.approx(0.1 * LOG2E)
    n_q_tiles = -(-n // 128)
    assert args["bh_count"] == 2 * 32 and args["n_q_tiles"] == n_q_tiles
    assert launch.fn == ("launcher", (2 * 32 * n_q_tiles, 1, 1))
    sig = signature(PHI96, "fp16", tpl.config(PHI96))
    assert sig["k_desc"].startswith("tensordesc<fp16[64, 1, 128],NVMMASharedLayout(swizzle_byte_width=128")
    assert "rank=3" in sig["k_desc"] and sig["v_desc"] == sig["k_desc"]


def test_hd128_launch_arguments_keep_the_2d_view():
    """The same host path at head_dim 128 still builds its 2-D [Tk, (Hkv - 1) * s_h + D] descriptors."""
    from sparsegen.kernels.prefill_gluon import ARG_NAMES

    n, hkv = 200, 8
    k = torch.randn(n, hkv, 128, dtype=torch.float16)
    cu = torch.tensor([0, n], dtype=torch.int32)
    _, launch = _prepared(PHI, k, k, n, cu, cu)
    args = dict(zip(ARG_NAMES, launch.args))
    assert list(args["k_desc"].shape) == [n, (hkv - 1) * 128 + 128]
    assert list(args["k_desc"].block_shape) == [64, 128] and args["stride_kh"] == 128
