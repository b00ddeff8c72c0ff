"""The fp8 K/V path of the CUDA paged-decode template on a CPU: what renders (and what does not
change for bf16/fp16), the request / key / name, NVRTC + ptxas for sm_90 (registers, no spills)
across spec kinds x head dims x e4m3 / e5m2, and the launcher's checks of the scales (typed
errors before anything touches a GPU). The GPU tier is test_decode_fp8_gpu.py."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from helpers import extras
from helpers.ptxas import ptxas_report
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import ImplUnavailableError, InputError
from sparsegen.kernels import base
from sparsegen.kernels import decode_template as dt
from sparsegen.kernels.families.decode import DecodeKernel
from sparsegen.testing import layer_specs

PHI3 = sparsegen.get_pattern("phi3small").layers[0]
DENSE = sparsegen.get_pattern("dense").layers[0]
# sliding window + sink tokens, a dense head, soft-cap and learned sinks in one layer
FEATURED = LayerSpec(
    4, 2, 128,
    (HeadSpec(block_size=16, sliding_window=100, sink_tokens=4), HeadSpec(dense=True),
     HeadSpec(block_size=32, local_blocks=2, vert_stride=4), HeadSpec(block_size=16, local_blocks=1, sink_tokens=7)),
    logit_softcap=30.0, learned_sinks=True,
)  # fmt: skip
KINDS = {"dense": DENSE, "phi3small": PHI3, "featured": FEATURED}
FP8_MARKS = ("kv_t", "cvt.rn.f16x2", "k_scale", "KV_FP8", "fp8")


@settings(max_examples=40, deadline=None)
@given(
    layer=layer_specs(max_kv_heads=2),
    dtype=st.sampled_from(("bf16", "fp16")),
    ps=st.sampled_from((8, 16, 24)),
)
def test_bf16_and_fp16_renders_carry_nothing_of_fp8(layer, dtype, ps):
    """The fp8 code sits in template blocks that are off for caches of q's dtype (the golden
    snapshot of test_decode_codegen pins one such render byte for byte)."""
    src = dt.render_source(layer, dtype, ps)
    assert src == dt.render_source(layer, dtype, ps, kv_dtype="")
    for mark in FP8_MARKS:
        assert mark not in src, mark


@pytest.mark.parametrize("kv, cvt", [("fp8e4m3", "e4m3x2"), ("fp8e5m2", "e5m2x2")])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp8_render(kv, cvt, dtype):
    src = dt.render_source(PHI3, dtype, 16, kv_dtype=kv)
    assert f'#define CVT_FP8 "{cvt}"' in src and "typedef unsigned char kv_t;" in src
    assert '#define MMA_T "f16"' in src  # both mma in fp16, whatever q's dtype
    assert "const kv_t* __restrict__ k_cache" in src and "const elem_t* __restrict__ k_cache" not in src
    assert "const float* __restrict__ k_scale, int ks_st" in src
    assert "scale_log2 *= k_scale[kvh * ks_st];" in src and "* vs;" in src
    assert "ld16_kv(p + 64 * y)" in src and "ld16_kv(p + 128 * x)" in src  # 16-byte K and V loads
    assert ("q_to_f16" in src) and (("__bfloat1622float2" in src) == (dtype == "bf16"))
    assert src != dt.render_source(PHI3, dtype, 16)
    assert "{{" not in src and "{%" not in src


def test_kernel_name_key_and_request():
    bf = base.KernelRequest.make("decode", PHI3, dtype=torch.bfloat16, arch="sm_90")
    assert bf.kv_dtype == "" and "kv_dtype" not in bf.params.key_extra()  # today's keys unchanged
    names = set()
    for spelling in (torch.float8_e4m3fn, "fp8", "fp8_e4m3", "fp8e4m3"):
        req = base.KernelRequest.make("decode", PHI3, dtype=torch.bfloat16, arch="sm_90", kv_dtype=spelling)
        assert req.kv_dtype == "fp8e4m3" and req.params.key_extra()["kv_dtype"] == "fp8e4m3"
        names.add(base.family(req).name(req))
    assert names == {"decode_bf16_kvfp8e4m3_hd128_ps16_g4_bs64_l16_v8"}
    e5 = base.KernelRequest.make("decode", PHI3, dtype=torch.float16, arch="sm_90", kv_dtype="fp8_e5m2")
    assert base.family(e5).name(e5).startswith("decode_fp16_kvfp8e5m2_hd128_")
    keys = {base.key_of(r).key.key for r in (bf, req, e5)}
    assert len(keys) == 3
    assert dt.kernel_name(PHI3, "bf16", 16) == "decode_bf16_hd128_ps16_g4_bs64_l16_v8"


@pytest.mark.parametrize("bad", [torch.bfloat16, torch.int8, "int8", "fp8e4m3fnuz", "", 8, "auto"])
def test_bad_kv_dtype_is_an_input_error(bad):
    with pytest.raises(InputError, match="kv_dtype"):
        base.KernelRequest.make("decode", PHI3, dtype=torch.bfloat16, arch="sm_90", kv_dtype=bad)
    with pytest.raises(InputError, match="kv_dtype"):
        dt.render_source(PHI3, "bf16", 16, kv_dtype=bad if isinstance(bad, str) and bad else "fp8")


def test_fp8_needs_sm89_and_prefill_refuses_it():
    with pytest.raises(ImplUnavailableError, match="sm_89"):
        base.KernelRequest.make("decode", PHI3, dtype=torch.bfloat16, arch="sm_80", kv_dtype="fp8")
    base.KernelRequest.make("decode", PHI3, dtype=torch.bfloat16, arch="sm_89", kv_dtype="fp8")
    for variant in ("tl", "gluon"):
        with pytest.raises(ImplUnavailableError, match="fp8e4m3 K/V"):
            base.KernelRequest.make("prefill", PHI3, dtype=torch.bfloat16, arch="sm_90", variant=variant,
                                    kv_dtype="fp8")  # fmt: skip


def _regs(src: str, arch: str = "sm_90") -> tuple[int, str]:
    report = ptxas_report(src, arch)
    main = report[report.index("entry function 'sparsegen_paged_decode'") :]
    main = main[: main.find("entry function", 10)] if "entry function" in main[10:] else main
    return int(re.search(r"Used (\d+) registers", main).group(1)), main


def _check_fits(layer: LayerSpec, dtype: str, kv: str, **knobs) -> None:
    """ptxas: within __launch_bounds__' register cap for the build's blocks per SM, no spills."""
    extras.require("cuda.core")
    src = dt.render_source(layer, dtype, 16, kv_dtype=kv, **knobs)
    regs, main = _regs(src)
    min_blocks = {**dt.default_knobs(layer.head_dim), **knobs}["min_blocks"]
    assert regs <= 65536 // (128 * min_blocks), main
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in main, main


def test_phi3small_fp8_kernel_fits_registers_without_spills():
    _check_fits(PHI3, "bf16", "fp8e4m3")


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fp8_kinds_by_head_dims_fit(kind, head_dim):
    _check_fits(replace(KINDS[kind], head_dim=head_dim), "bf16", "fp8e4m3")


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_dim, dtype, kv, knobs",
    [
        (128, "bf16", "fp8e5m2", {}),
        (64, "fp16", "fp8e5m2", {}),
        (32, "bf16", "fp8e4m3", {}),
        (48, "bf16", "fp8e4m3", {}),  # a 32-dim K rest and the 16-dim tail
        (96, "fp16", "fp8e4m3", {}),
        (208, "bf16", "fp8e4m3", {}),  # V: 128 + 64 + 16
        (240, "bf16", "fp8e5m2", {}),  # V: 128 + 64 + 32 + 16
        (128, "bf16", "fp8e4m3", {"pipeline": 1, "q_smem": 1}),
        (128, "bf16", "fp8e4m3", {"fused_merge": 0, "qk_accs": 4, "min_blocks": 3}),
    ],
)
def test_fp8_odd_dims_e5m2_and_knobs_fit(head_dim, dtype, kv, knobs):
    _check_fits(replace(FEATURED, head_dim=head_dim), dtype, kv, **knobs)


# The launcher's checks: a kernel object whose cubin is never loaded (every check comes first).


def _kernel(layer: LayerSpec, kv) -> DecodeKernel:
    req = base.KernelRequest.make("decode", layer, dtype=torch.bfloat16, arch="sm_90", kv_dtype=kv)
    return DecodeKernel(req, "key", base.family(req).name(req), "/nonexistent", "", b"")


def _args(layer: LayerSpec, cache_dtype):
    q = torch.randn(2, layer.num_heads, layer.head_dim).to(torch.bfloat16)  # q: [B, H, D]
    k = torch.randn(4, 16, layer.num_kv_heads, layer.head_dim).to(cache_dtype)  # [pages, ps, Hkv, D]
    v = torch.randn(4, 16, layer.num_kv_heads, layer.head_dim).to(cache_dtype)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    return q, k, v, tables, lens


HKV = PHI3.num_kv_heads
ONES = torch.ones(HKV)
BAD_SCALES = [
    ({}, "pass k_scale="),
    ({"k_scale": ONES}, "pass v_scale="),
    ({"k_scale": ONES.half(), "v_scale": ONES}, "k_scale must be float32"),
    ({"k_scale": ONES, "v_scale": ONES.double()}, "v_scale must be float32"),
    ({"k_scale": torch.ones(HKV + 1), "v_scale": ONES}, r"k_scale must have shape \[8\] or \[\]"),
    ({"k_scale": ONES, "v_scale": torch.ones(1, HKV)}, "v_scale must have shape"),
    ({"k_scale": torch.ones(1), "v_scale": ONES}, "k_scale must have shape"),
    ({"k_scale": torch.ones(2 * HKV)[::2], "v_scale": ONES}, "k_scale must be contiguous"),
    ({"k_scale": ONES.to("meta"), "v_scale": ONES}, "k_scale is a meta tensor"),
    ({"k_scale": ONES, "v_scale": [1.0] * HKV}, "v_scale must be a torch.Tensor"),
]


@pytest.mark.parametrize("kwargs, match", BAD_SCALES)
def test_launch_checks_fp8_scales(kwargs, match):
    kernel = _kernel(PHI3, "fp8")
    with pytest.raises(InputError, match=match):
        kernel.launch(*_args(PHI3, torch.float8_e4m3fn), 0.1, **kwargs)


@pytest.mark.parametrize("kwargs, match", BAD_SCALES[:8])
def test_calling_the_kernel_checks_fp8_scales(kwargs, match):
    """The public call (`kernel(q, ...)`) gives the same errors through validate.check_features."""
    with pytest.raises(InputError, match=match):
        _kernel(PHI3, "fp8")(*_args(PHI3, torch.float8_e4m3fn), **kwargs)


def test_launch_refuses_scales_with_a_bf16_cache_and_mismatched_caches():
    with pytest.raises(InputError, match="only for fp8"):
        _kernel(PHI3, None).launch(*_args(PHI3, torch.bfloat16), 0.1, k_scale=ONES, v_scale=ONES)
    with pytest.raises(InputError, match="reads bf16 K/V, the cache holds torch.float8_e4m3fn"):
        _kernel(PHI3, None).launch(*_args(PHI3, torch.float8_e4m3fn), 0.1, k_scale=ONES, v_scale=ONES)
    with pytest.raises(InputError, match="reads fp8e4m3 K/V, the cache holds torch.bfloat16"):
        _kernel(PHI3, "fp8").launch(*_args(PHI3, torch.bfloat16), 0.1)
    with pytest.raises(InputError, match="reads fp8e4m3 K/V, the cache holds torch.float8_e5m2"):
        _kernel(PHI3, "fp8").launch(*_args(PHI3, torch.float8_e5m2), 0.1, k_scale=ONES, v_scale=ONES)


def test_learned_sinks_and_scales_together_are_checked():
    kernel = _kernel(FEATURED, "fp8")
    args = _args(FEATURED, torch.float8_e4m3fn)
    ones = torch.ones(FEATURED.num_kv_heads)
    with pytest.raises(InputError, match="sinks= is required"):
        kernel.launch(*args, 0.1, k_scale=ones, v_scale=ones)
    with pytest.raises(InputError, match="sinks must have shape"):
        kernel.launch(*args, 0.1, k_scale=ones, v_scale=ones, sinks=torch.ones(FEATURED.num_heads + 1))


def test_model_kernel_plan_adds_the_fp8_rotary_writes():
    """`compile --model-kernels --kv-cache-dtype fp8` also builds the rotary kernel's fp8 write."""
    from sparsegen.models.config import Phi3SmallConfig
    from sparsegen.models.kernel_plan import model_kernel_requests

    plain = model_kernel_requests(Phi3SmallConfig(), torch.bfloat16, "sm_90", 16)
    fp8 = model_kernel_requests(Phi3SmallConfig(), torch.bfloat16, "sm_90", 16, torch.float8_e4m3fn)
    extra = [base.family(r).name(r) for r in fp8 if r not in plain]
    assert extra and all(n.startswith("rotary_kv_write_bf16_") and n.endswith("_fp8") for n in extra)
    assert not any(base.family(r).name(r).endswith("_fp8") for r in plain)
