"""The decode template's attention features (sink tokens, soft-cap, learned sinks) and head dims
32..256 on the CPU: the rendered constants, today's specs unchanged, the family's declarations,
and the NVRTC builds for sm_90 with ptxas's register and spill counts."""

from __future__ import annotations

import math
import re
import struct

import pytest
from helpers.ptxas import ptxas_report

from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import ImplUnavailableError
from sparsegen.kernels import decode_template as dt
from sparsegen.kernels.base import KernelRequest

LOCAL = HeadSpec(block_size=64, local_blocks=4, vert_stride=8)


def _layer(hd: int, *, sinks=0, softcap=0.0, learned=False) -> LayerSpec:
    head = HeadSpec(block_size=64, local_blocks=4, vert_stride=8, sink_tokens=sinks)
    return LayerSpec(4, 1, hd, (head,) * 4, logit_softcap=softcap, learned_sinks=learned)


def _bits_float(text: str, name: str) -> float:
    m = re.search(rf"#define {name} __int_as_float\((-?\d+)\)", text)
    assert m, name
    return struct.unpack("<f", struct.pack("<i", int(m.group(1))))[0]


def test_features_off_render_no_feature_code():
    src = dt.render_source(_layer(128), "bf16", 16)
    for word in ("SOFTCAP", "sinks", "LOG2E", "TAIL16", "tanhf", "ld8_tail"):
        assert word not in src, word


def test_sink_tokens_enter_sees_and_tile_needed():
    src = dt.render_source(_layer(64, sinks=7), "bf16", 16)
    assert "|| j < 7)" in src
    assert "if (t0 < 7) return true;" in src


def test_softcap_constants_are_c_log2e_and_its_reciprocal():
    src = dt.render_source(_layer(64, softcap=30.0), "fp16", 16)
    c_l2 = _bits_float(src, "SOFTCAP_L2")
    inv = _bits_float(src, "SOFTCAP_INV_L2")
    assert c_l2 == pytest.approx(30.0 * math.log2(math.e), rel=1e-7)
    assert inv == pytest.approx(1 / (30.0 * math.log2(math.e)), rel=1e-7)
    assert src.count("tanhf(") == 2


def test_learned_sinks_are_the_last_argument_of_both_kernels_and_enter_each_merge_once():
    src = dt.render_source(_layer(64, learned=True), "bf16", 16)
    for fn in (dt.KERNEL, dt.REDUCE):
        head = re.search(rf"{fn}\((.*?)\)\s*{{", src, re.S).group(1)
        assert head.strip().endswith("const float* __restrict__ sinks"), fn
    # the unsplit normalisation, the separate merge and the fused merge: one sink term each
    assert src.count("exp2f(sinks[") == 3


@pytest.mark.parametrize("hd", [48, 80, 112, 144, 176, 208, 240])
def test_a_16_dim_tail_renders_its_loads(hd):
    src = dt.render_source(_layer(hd), "bf16", 16)
    assert "#define TAIL16 1" in src
    assert "ld8_tail(p + 32 * KVEC - 4 * w.c)" in src and "ld4_tail(" in src
    assert "if (t == KSTEPS - 1) return 64 * V64 + 32 * VTAIL + 2 * g;" in src
    assert "TAIL16" not in dt.render_source(_layer(hd + 16), "bf16", 16)  # a multiple of 32: none


def test_head_dims_above_128_lower_the_blocks_per_sm_cap():
    assert dt.template_constants(_layer(128), "bf16", 16)["min_blocks"] == 4
    assert dt.template_constants(_layer(192), "bf16", 16)["min_blocks"] == 3
    assert dt.template_constants(_layer(256), "bf16", 16)["min_blocks"] == 2
    assert dt.template_constants(_layer(256), "bf16", 16, min_blocks=1)["min_blocks"] == 1


def test_the_family_declares_the_features_and_every_head_dim():
    for hd in range(32, 257, 16):
        layer = _layer(hd, sinks=4, softcap=50.0, learned=True)
        KernelRequest.make("decode", layer, dtype="bf16", arch="sm_90", page_size=16)
    assert dt.HEAD_DIMS == tuple(range(32, 257, 16))


def test_a_head_dim_outside_the_family_is_refused(monkeypatch):
    from sparsegen.kernels.families import decode as fam

    monkeypatch.setattr(fam.CudaDecode, "head_dims", (64,))
    with pytest.raises(ImplUnavailableError, match="head_dim"):
        KernelRequest.make("decode", _layer(48), dtype="bf16", arch="sm_90", page_size=16)


AOT = [  # (head_dim, features): every feature at every head dim the brief names, bf16 and fp16
    (hd, feats) for hd in (32, 48, 80, 128, 256) for feats in ("none", "all")
]


def _main_entry(report: str) -> str:
    return report[report.index("entry function 'sparsegen_paged_decode'") :]


@pytest.mark.slow
@pytest.mark.parametrize("hd,feats", AOT, ids=lambda x: str(x))
def test_nvrtc_builds_for_sm90_within_the_register_cap_without_spills(hd, feats):
    on = feats == "all"
    layer = _layer(hd, sinks=4 if on else 0, softcap=50.0 if on else 0.0, learned=on)
    dtype = "bf16" if hd % 32 == 0 else "fp16"
    consts = dt.template_constants(layer, dtype, 16)
    report = ptxas_report(dt.render_source(layer, dtype, 16), "sm_90")
    main = _main_entry(report)
    regs = int(re.search(r"Used (\d+) registers", main).group(1))
    cap = min(255, 65536 // (128 * consts["min_blocks"]) // 8 * 8)
    assert regs <= cap, main
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in main, main
