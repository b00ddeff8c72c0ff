"""The tl prefill's narrow-window rule (prefill_template.narrow_config): which layers get packed
GQA heads and narrow key tiles, what the render holds, and that every other layer's config, and
so its source and key, stays as it was. The kernels run in test_prefill_narrow_interpreter.py
(CPU) and test_prefill_narrow_gpu.py (GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from sparsegen import HeadSpec, LayerSpec, get_pattern
from sparsegen.kernels import prefill_template as tpl
from sparsegen.kernels.base import KernelRequest as Request
from sparsegen.kernels.families.prefill_tl import TritonPrefill
from sparsegen.testing import sample_layer_spec

GPT_OSS = LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True)


def _window(w: int, heads: int = 8, kv: int = 1, head_dim: int = 64, **head) -> LayerSpec:
    return LayerSpec(heads, kv, head_dim, (HeadSpec(sliding_window=w, **head),) * heads)


def _narrow(layer, arch="sm_90", dtype="bf16"):
    return tpl.narrow_config(layer, tpl.pick_config(dtype, layer.head_dim, arch), arch)


def test_gpt_oss_packs_its_8_heads_into_16_row_tiles_of_32_keys():
    assert _narrow(GPT_OSS) == {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3, "pack": 8}
    assert _narrow(GPT_OSS, "interpreter", "fp16")["pack"] == 8  # 4 positions x 8 heads in 32 rows


@pytest.mark.parametrize(
    "group,pack",
    [(2, 2), (4, 4), (6, 2), (8, 8), (16, 8), (12, 4)],
)
def test_pack_is_the_largest_power_of_two_of_the_group_that_leaves_16_rows(group, pack):
    assert _narrow(_window(64, heads=group * 2, kv=2))["pack"] == pack


def test_no_gqa_gets_a_64_row_tile_instead():
    assert _narrow(_window(128, heads=4, kv=4)) == {
        "block_m": 64,
        "block_n": 32,
        "num_warps": 4,
        "num_stages": 3,
    }
    interp = _narrow(_window(128, heads=4, kv=4), "interpreter", "fp16")
    assert interp == tpl.pick_config("fp16", 64, "interpreter")  # nothing to narrow there


@pytest.mark.parametrize(
    "layer",
    [
        _window(129),  # one key past the narrow bound
        _window(4096),
        _window(64, head_dim=256),  # 256-wide tiles on a GPU are already 64 x 32
        LayerSpec(
            8, 1, 64, (HeadSpec(sliding_window=64),) * 7 + (HeadSpec(sliding_window=32),)
        ),  # heads differ
        LayerSpec(8, 1, 64, (HeadSpec(sliding_window=64),) * 7 + (HeadSpec(dense=True),)),
        _window(64, local_blocks=1),  # local + window: the near range is not narrow
        _window(64, vert_stride=4),
        LayerSpec(8, 1, 64, (HeadSpec(dense=True),) * 8),
        get_pattern("phi3small").layers[0],
        get_pattern("sliding-window").layers[0],
    ],
    ids=[
        "w129",
        "w4096",
        "hd256",
        "mixed_w",
        "mixed_dense",
        "local",
        "vert",
        "dense",
        "phi3small",
        "mistral",
    ],
)
def test_other_layers_keep_their_config_object(layer):
    for arch in ("sm_90", "sm_80", "sm_86"):
        config = tpl.pick_config("bf16", layer.head_dim, arch)
        assert tpl.narrow_config(layer, config, arch) is config


def test_sampled_layers_keep_their_configs_unless_narrow():
    """Over random specs, the rule changes only layers of one plain window <= 128 keys."""
    rng = random.Random(28)
    changed = 0
    for i in range(300):
        layer = sample_layer_spec(rng, hybrid=bool(i % 2), head_dims=(64, 128, 256), ratios=(1, 2, 8),
                                  windows=(1, 17, 100, 128, 129, 5000))  # fmt: skip
        config = tpl.pick_config("bf16", layer.head_dim, "sm_90")
        got = tpl.narrow_config(layer, config, "sm_90")
        head = layer.heads[0]
        narrow = (all(h == head for h in layer.heads) and head.kind in ("window", "window+sink")
                  and head.sliding_window <= 128 and layer.head_dim <= 128)  # fmt: skip
        assert (got is not config) == narrow, layer
        changed += narrow
    assert changed > 0  # the sample did reach the rule


def test_family_config_is_the_narrow_one_and_the_source_says_so():
    fam = TritonPrefill()
    request = Request.make("prefill", GPT_OSS, dtype="bf16", arch="sm_90", variant="tl")
    assert fam.config(request)["pack"] == 8
    source = fam.render(request)
    assert "PACK = tl.constexpr(8)" in source and "TILE_ROWS = tl.constexpr(16)" in source
    assert "BLOCK_N = tl.constexpr(32)" in source
    assert "h_row = h + offs_m // TILE_ROWS" in source and "tl.load(Sinks + h_row)" in source
    assert "m0 = tile * TILE_ROWS" in source and "seq = bh // (NUM_HEADS // PACK)" in source
    plain = fam.render(
        Request.make(
            "prefill", get_pattern("sliding-window").layers[0], dtype="bf16", arch="sm_90", variant="tl"
        )
    )
    assert "PACK" not in plain and "h_row" not in plain and "TILE_ROWS" not in plain


@pytest.mark.slow
def test_packed_kernel_compiles_for_sm90_without_a_gpu(fresh_cache):
    from sparsegen.kernels.prefill import get_prefill_kernel

    kernel = get_prefill_kernel(GPT_OSS, dtype=torch.bfloat16, arch="sm_90", variant="tl")
    assert kernel.config["pack"] == 8 and (kernel.path / "prefill_kernel.cubin").stat().st_size > 0
