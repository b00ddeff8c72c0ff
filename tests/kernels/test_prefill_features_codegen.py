"""The tl prefill template's attention features: what renders, the names, the family's
declarations, and AOT builds for sm_90 on a CPU machine."""

from __future__ import annotations

import pytest
import torch

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import ImplUnavailableError
from sparsegen.kernels import prefill_template as tpl
from sparsegen.kernels.families.prefill_tl import TritonPrefill

WINDOW = HeadSpec(block_size=64, sliding_window=128)
CONFIG = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}

VARIANTS = {
    "sink_tokens": LayerSpec(4, 2, 64, (HeadSpec(block_size=64, sliding_window=128, sink_tokens=4),) * 4),
    "softcap_hd256": LayerSpec(
        4, 2, 256, (WINDOW, HeadSpec(dense=True)) * 2, logit_softcap=50.0, scale=224**-0.5
    ),  # fmt: skip
    "learned_sinks": LayerSpec(8, 1, 64, (WINDOW,) * 8, learned_sinks=True),
    "hd48_vert_sinks": LayerSpec(
        2, 1, 48, (HeadSpec(block_size=64, local_blocks=2, vert_stride=4, vert_offset=1, sink_tokens=16),) * 2
    ),
    "hd160_all": LayerSpec(
        2,
        1,
        160,
        (HeadSpec(block_size=32, sliding_window=40, sink_tokens=2),) * 2,
        logit_softcap=30.5,
        learned_sinks=True,
    ),  # fmt: skip
}


def test_family_declares_the_features_and_head_dims():
    fam = TritonPrefill()
    assert fam.features == {"sink_tokens", "logit_softcap", "learned_sinks"}
    assert fam.head_dims == tuple(range(32, 257, 16))


def test_plain_layers_render_without_feature_code():
    src = tpl.render_source(LayerSpec(2, 1, 64, (WINDOW,) * 2), CONFIG)
    for word in ("SOFTCAP", "Sinks", "sink_tokens", "TANH_EXP2"):
        assert word not in src


def test_feature_render_and_names():
    src = tpl.render_source(VARIANTS["hd160_all"], CONFIG)
    assert "SOFTCAP_LOG2 = tl.constexpr(61 / 2 * 1.4426950408889634)" in src
    assert "def prefill_kernel(Q, K, V, O, Sinks, cu_seqlens_q" in src
    assert "sink_tokens = 2" in src
    assert (
        tpl.kernel_name(VARIANTS["hd160_all"], "bf16") == "prefill_bf16_hd160_h2kv1_bs32_w40_s2_cap30p5_lsink"
    )
    assert tpl.kernel_name(VARIANTS["sink_tokens"], "fp16") == "prefill_fp16_hd64_h4kv2_bs64_w128_s4"
    per_head = LayerSpec(2, 1, 64, (HeadSpec(block_size=64, sliding_window=8, sink_tokens=1),
                                    HeadSpec(block_size=64, sliding_window=8, sink_tokens=5)))  # fmt: skip
    assert "tl.where((h == 1), 5, sink_tokens)" in tpl.render_source(per_head, CONFIG)
    assert tpl.kernel_name(per_head, "fp16").endswith("_s1to5")


def test_signature_adds_the_sinks_pointer_only_with_learned_sinks():
    assert "Sinks" not in tpl.signature("bf16")
    sig = list(tpl.signature("bf16", True))
    assert sig[:6] == ["Q", "K", "V", "O", "Sinks", "cu_seqlens_q"]
    assert tpl.arg_names(VARIANTS["learned_sinks"]) == tuple(sig)
    assert tpl.arg_names(VARIANTS["sink_tokens"]) == tuple(tpl.signature("bf16"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_big_head_dims_take_smaller_tiles(arch):
    small = tpl.pick_config("bf16", 128, arch)
    big = tpl.pick_config("bf16", 256, arch)
    assert small["block_m"] == 128  # today's configs hold (they are in the keys)
    assert big["block_m"] * big["block_n"] < small["block_m"] * small["block_n"]
    # K and V stages and the Q tile, 2 bytes an element, fit sm_80's 164 KB of shared memory
    smem = 2 * 256 * (big["block_m"] + 2 * big["block_n"] * big["num_stages"])
    assert smem <= 164 * 1024


@pytest.mark.parametrize("head_dim", [16, 24, 272])
def test_head_dims_outside_the_family_are_refused(head_dim):
    from sparsegen.errors import SpecError

    try:
        layer = LayerSpec(2, 1, head_dim, (WINDOW,) * 2)
    except SpecError:
        return  # the spec itself refuses it first
    with pytest.raises(ImplUnavailableError, match="head_dim"):
        sparsegen.get_kernel(layer, "prefill", dtype=torch.float16, arch="sm_90")


def test_gluon_default_takes_the_features_it_covers():
    """The Gluon kernel covers these features (test_prefill_gluon_features.py); sink tokens on a
    vertical-stride head stay with the tl kernel, and so does a window-128 layer whose query heads
    the tl kernel packs (faster there)."""
    from sparsegen.kernels import base

    wide = LayerSpec(8, 1, 64, (HeadSpec(block_size=64, sliding_window=1024),) * 8, learned_sinks=True)
    assert base.default_variant("prefill", "sm_90", wide, "bf16") == "gluon"
    assert base.default_variant("prefill", "sm_90", VARIANTS["learned_sinks"], "bf16") == "tl"
    assert base.default_variant("prefill", "sm_90", VARIANTS["hd48_vert_sinks"], "bf16") == "tl"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_aot_build_for_sm90(name, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("the GPU tier builds and runs these (test_prefill_features_gpu.py)")
    kernel = sparsegen.get_kernel(VARIANTS[name], "prefill", dtype=torch.bfloat16, arch="sm_90", variant="tl")
    assert kernel.request.variant == "tl"
    assert (kernel.path / "prefill_kernel.cubin").stat().st_size > 0
    assert kernel.name == tpl.kernel_name(VARIANTS[name], "bf16")
