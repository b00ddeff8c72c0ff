"""Rendering of the Triton prefill template: golden snapshot, literals, typed constants only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import CompileError
from sparsegen.jit import triton_build

GOLDEN = Path(__file__).parent / "golden" / "prefill_phi3small_sm90.py.txt"


def _phi3_sparse() -> LayerSpec:
    return sparsegen.get_pattern("phi3small").layers[0]


def test_phi3small_source_matches_golden():
    """After a deliberate template change, regenerate the snapshot with tests/golden/regenerate.py."""
    source = triton_build.render_source(_phi3_sparse(), triton_build.pick_config("bf16", 128, "sm_90"))
    assert source == GOLDEN.read_text()


def test_rendered_source_is_valid_python_with_pattern_literals():
    source = triton_build.render_source(_phi3_sparse(), triton_build.pick_config("bf16", 128, "sm_90"))
    ast.parse(source)
    assert "vo = (h * 1 + 0) % 8" in source  # per-head offsets computed from literals
    assert "(top // 64 - 15) * 64" in source  # 16 local blocks of 64
    assert "range(8 - 1 - vo, a // 64, 8)" in source  # the vertical-stride loop
    assert "BLOCK_M = tl.constexpr(128)" in source


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
    assert "D_PAD = tl.constexpr(128)" in source and "offs_d[None, :] < HEAD_DIM" in source
    assert "elif (h == 1):" in source


def test_non_affine_offsets_render_a_select_chain():
    offsets = [0, 3, 1, 1]
    heads = tuple(HeadSpec(block_size=16, local_blocks=1, vert_stride=4, vert_offset=o) for o in offsets)
    layer = LayerSpec(num_heads=4, num_kv_heads=1, head_dim=64, heads=heads)
    source = triton_build.render_source(layer, triton_build.pick_config("fp16", 64, "sm_90"))
    assert "vo = tl.where(h == 1, 3, vo)" in source


def test_free_strings_never_reach_the_template():
    with pytest.raises(CompileError, match="not an allowed word"):
        sparsegen.codegen.render(triton_build.TEMPLATE, evil="import os")


def test_arch_spelling_is_checked():
    with pytest.raises(sparsegen.ArchError, match="arch"):
        triton_build.pick_config("bf16", 128, "hopper")
    assert triton_build.pick_config("bf16", 128, "sm_90a") == triton_build.pick_config("bf16", 128, "sm_90")
