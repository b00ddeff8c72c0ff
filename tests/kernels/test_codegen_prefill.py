"""Rendering of the Triton prefill template: golden snapshot, literals, typed constants only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import CompileError
from sparsegen.jit import render
from sparsegen.kernels import prefill_template as triton_build

GOLDEN = Path(__file__).parent / "golden" / "prefill_phi3small_sm90.py.txt"


def _phi3_sparse() -> LayerSpec:
    return sparsegen.get_pattern("phi3small").layers[0]


def test_phi3small_source_matches_golden():
    """After a deliberate template change, regenerate the snapshot with tests/kernels/golden/regenerate.py."""
    source = triton_build.render_source(_phi3_sparse(), triton_build.pick_config("bf16", 128, "sm_90"))
    assert source == GOLDEN.read_text()


def test_rendered_source_is_valid_python_with_pattern_literals():
    source = triton_build.render_source(_phi3_sparse(), triton_build.pick_config("bf16", 128, "sm_90"))
    ast.parse(source)
    # a uniform layer keeps every per-head number a literal (fully constant-folded)
    assert "    local_blocks = 16\n    vert_stride = 8\n" in source
    assert "vert_offset = (h * 1 + 0) % vert_stride" in source  # per-head offsets: an affine rule
    assert "tl.where" not in source.split("def _path_0")[1].split("offs_m")[0]
    assert "(top // 64 - (local_blocks - 1)) * 64" in source  # 16 local blocks of 64
    assert "range(vert_stride - 1 - vert_offset, a // 64, vert_stride)" in source
    assert "BLOCK_M = tl.constexpr(128)" in source
    assert "PAD_HEAD_DIM = tl.constexpr(False)" in source


def test_hybrid_layer_gets_one_path_per_kind():
    heads = (
        HeadSpec(block_size=32, sliding_window=100),
        HeadSpec(dense=True),
        HeadSpec(block_size=16, local_blocks=2, vert_stride=3, vert_offset=2),
        HeadSpec(block_size=32, sliding_window=100),
    )
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=96, heads=heads)
    source = triton_build.render_source(layer, triton_build.pick_config("fp16", 96, "sm_90"))
    ast.parse(source)
    assert source.count("@triton.jit\ndef _path_") == 3
    assert "HEAD_DIM_POW2 = tl.constexpr(128)" in source and "PAD_HEAD_DIM = tl.constexpr(True)" in source
    assert "elif (h == 1):" in source
    assert triton_build.kernel_name(layer, "fp16") == (
        "prefill_fp16_hd96_h4kv2_2xbs32_w100__1xdense__1xbs16_l2_v3"
    )


def test_distinct_heads_of_one_kind_share_one_path():
    """Compile time stays flat: 32 distinct local+vert heads are one path with per-head scalars."""
    heads = tuple(
        HeadSpec(block_size=64, local_blocks=1 + h % 16, vert_stride=2 + h // 16 + h % 5, vert_offset=h % 2)
        for h in range(32)
    )
    layer = LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128, heads=heads)
    source = triton_build.render_source(layer, triton_build.pick_config("bf16", 128, "sm_90"))
    ast.parse(source)
    assert source.count("@triton.jit\ndef _path_") == 1
    assert "local_blocks = tl.where(" in source and "vert_stride = tl.where(" in source
    assert triton_build.kernel_name(layer, "bf16") == "prefill_bf16_hd128_h32kv8_bs64_l1to16_v2to7"


def test_non_affine_offsets_render_a_select_chain():
    offsets = [0, 3, 1, 1]
    heads = tuple(HeadSpec(block_size=16, local_blocks=1, vert_stride=4, vert_offset=o) for o in offsets)
    layer = LayerSpec(num_heads=4, num_kv_heads=1, head_dim=64, heads=heads)
    source = triton_build.render_source(layer, triton_build.pick_config("fp16", 64, "sm_90"))
    assert "vert_offset = h * 0 + 1  # per head: 1 unless below" in source  # the most common value
    assert "vert_offset = tl.where((h == 0), 0, vert_offset)" in source
    assert "vert_offset = tl.where((h == 1), 3, vert_offset)" in source


def test_free_strings_never_reach_the_template():
    with pytest.raises(CompileError, match="not an allowed word"):
        render.render(triton_build.TEMPLATE, evil="import os")


def test_arch_spelling_is_checked():
    with pytest.raises(sparsegen.ArchError, match="arch"):
        triton_build.pick_config("bf16", 128, "hopper")
    assert triton_build.pick_config("bf16", 128, "sm_90a") == triton_build.pick_config("bf16", 128, "sm_90")
