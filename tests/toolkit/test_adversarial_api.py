"""Attacks on the public API boundary: every bad value is a typed error before anything runs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsegen
from sparsegen import ArchError, HeadSpec, ImplUnavailableError, InputError, LayerSpec
from sparsegen.jit import nvrtc_build
from sparsegen.testing import DecodeProblem, PrefillProblem
from sparsegen.validate import MAX_SCALE, MIN_SCALE, softmax_scale

LAYER = LayerSpec(2, 1, 64, (HeadSpec(block_size=16, local_blocks=2, vert_stride=3, vert_offset=1),) * 2)


def _prefill_args():
    return PrefillProblem(LAYER, q_lens=[5, 17], k_lens=[9, 17], seed=1, dtype=torch.float32).args()


def _decode_args():
    return DecodeProblem(LAYER, seq_lens=[3, 40], page_size=16, seed=2, dtype=torch.float32).args()


BAD_SCALES = [True, False, "0.1", b"0.1", [0.1], (0.1,), {}, object(), 1j, torch.tensor(0.1), 0, 0.0, -0.1,
              -1, math.nan, math.inf, -math.inf, 1e39, 3e38, 1e-39, 5e-324, 10**400]  # fmt: skip


@pytest.mark.parametrize("scale", BAD_SCALES, ids=lambda s: repr(s)[:20])
def test_bad_scale_is_refused_by_both_entry_points(scale):
    q, k, v, cq, ck, layer, _ = _prefill_args()
    with pytest.raises(InputError, match="scale"):
        sparsegen.prefill(q, k, v, cq, ck, layer, scale)
    dq, kc, vc, bt, sl, dlayer, _ = _decode_args()
    with pytest.raises(InputError, match="scale"):
        sparsegen.paged_decode(dq, kc, vc, bt, sl, dlayer, scale)


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**40), 10**40)))
@settings(max_examples=200)
def test_scale_range_is_exactly_the_fp32_bound(scale):
    ok = math.isfinite(scale) and MIN_SCALE <= float(scale) <= MAX_SCALE
    if ok:
        value = softmax_scale(scale, 64)
        assert math.isfinite(value * 1.4426950408889634) and value > 0
    else:
        with pytest.raises(InputError, match="scale"):
            softmax_scale(scale, 64)


def test_good_scales_pass():
    import numpy as np

    for scale in (1, 0.125, np.float32(0.1), np.float64(2.0), MAX_SCALE, MIN_SCALE, None):
        assert softmax_scale(scale, 64) > 0


BAD_LAYERS = [None, 42, "phi3small", {"num_heads": 2}, HeadSpec(block_size=16, local_blocks=1), (LAYER,)]


@pytest.mark.parametrize("layer", BAD_LAYERS, ids=lambda x: type(x).__name__)
def test_non_layerspec_is_named(layer):
    q, k, v, cq, ck, _, _ = _prefill_args()
    with pytest.raises(InputError, match=f"LayerSpec, got {type(layer).__name__}"):
        sparsegen.prefill(q, k, v, cq, ck, layer)
    dq, kc, vc, bt, sl, _, _ = _decode_args()
    with pytest.raises(InputError, match=f"LayerSpec, got {type(layer).__name__}"):
        sparsegen.paged_decode(dq, kc, vc, bt, sl, layer)
    with pytest.raises(InputError, match="LayerSpec"):
        sparsegen.get_kernel(layer, "decode", dtype=torch.float16, arch="sm_90")


def test_model_spec_is_not_a_layer():
    model = sparsegen.get_pattern("phi3small")
    q, k, v, cq, ck, _, _ = _prefill_args()
    with pytest.raises(InputError, match="ModelSpec"):
        sparsegen.prefill(q, k, v, cq, ck, model)


@pytest.mark.parametrize("which", range(5))
def test_meta_tensors_are_refused(which):
    args = list(_prefill_args())
    args[which] = args[which].to("meta")
    with pytest.raises(InputError, match="meta tensor"):
        sparsegen.prefill(*args)
    dargs = list(_decode_args())
    dargs[which] = dargs[which].to("meta")
    with pytest.raises(InputError, match="meta"):
        sparsegen.paged_decode(*dargs)


@pytest.mark.parametrize(
    "arch",
    [90, 90.0, "sm_90aa", "", "sm_", "sm_70", "hopper", "SM_90", b"sm_90", "sm_9O", ["sm_90"]],
)
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_bad_arch_is_a_typed_error(arch, kind):
    with pytest.raises(ArchError, match="arch"):
        sparsegen.get_kernel(LAYER, kind, dtype=torch.float16, arch=arch)


@pytest.mark.parametrize("impl", ["cuda", "TRITON", "", 1, True, "reference "])
def test_bad_impl(impl):
    q, k, v, cq, ck, layer, _ = _prefill_args()
    with pytest.raises(InputError, match="impl"):
        sparsegen.prefill(q, k, v, cq, ck, layer, impl=impl)


@pytest.mark.parametrize("check", ["yes", 1, 0, "False"])
def test_check_must_be_a_bool(check):
    q, k, v, cq, ck, layer, _ = _prefill_args()
    with pytest.raises(InputError, match="check"):
        sparsegen.prefill(q, k, v, cq, ck, layer, check=check)


@pytest.mark.parametrize("pdl", ["yes", 1, 0, None, "False"])
def test_decode_pdl_must_be_a_bool(pdl):
    from sparsegen.testing import DecodeProblem

    p = DecodeProblem(LAYER, [5, 40], 8, seed=0)
    with pytest.raises(InputError, match="pdl"):
        sparsegen.paged_decode(*p.args(), pdl=pdl)


def test_decode_kernel_call_checks_pdl_first():
    from sparsegen.testing import DecodeProblem

    kernel = sparsegen.get_kernel(LAYER, "decode", dtype=torch.float16, arch="sm_90", page_size=8)
    q, kc, vc, bt, sl, _, _ = DecodeProblem(LAYER, [5, 40], 8, seed=0, dtype=torch.float16).args()
    with pytest.raises(InputError, match="pdl"):
        kernel(q, kc, vc, bt, sl, pdl=1)


def test_decode_pdl_is_a_launch_hint_the_reference_ignores():
    from sparsegen.testing import DecodeProblem

    p = DecodeProblem(LAYER, [5, 40], 8, seed=0)
    assert torch.equal(sparsegen.paged_decode(*p.args(), pdl=True), sparsegen.paged_decode(*p.args()))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", torch.tensor(8)])
def test_bad_max_seqlen(monkeypatch, bad):
    from sparsegen.validate import check_cu_seqlens

    q, k, v, cq, ck, layer, _ = _prefill_args()
    with pytest.raises(InputError, match="max_seqlen_k"):
        check_cu_seqlens(cq, ck, q.shape[0], k.shape[0], max_seqlen_k=bad)


def test_max_seqlen_smaller_than_a_sequence_is_caught_when_checking():
    from sparsegen.validate import check_cu_seqlens

    q, k, v, cq, ck, layer, _ = _prefill_args()
    check_cu_seqlens(cq, ck, q.shape[0], k.shape[0], max_seqlen_q=17, max_seqlen_k=17)
    with pytest.raises(InputError, match="max_seqlen_k 16"):
        check_cu_seqlens(cq, ck, q.shape[0], k.shape[0], max_seqlen_k=16)
    with pytest.raises(InputError, match="max_seqlen_q 4"):
        check_cu_seqlens(cq, ck, q.shape[0], k.shape[0], max_seqlen_q=4)


def test_misaligned_tensors_are_refused_not_copied():
    from sparsegen.validate import check_alignment

    base = torch.zeros(40, 2, 72)
    with pytest.raises(InputError, match="multiples of 16"):
        check_alignment("q", base[:, :, :64])  # strides (144, 72, 1)
    with pytest.raises(InputError, match="aligned"):
        check_alignment("k", torch.zeros(1000)[1:129].view(2, 64))  # a 4-byte-offset base
    with pytest.raises(InputError, match="last dim"):
        check_alignment("v", torch.zeros(64, 32).t())
    check_alignment("q", torch.zeros(8, 2, 64))


def test_bf16_in_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ImplUnavailableError, match="bf16"):
        sparsegen.get_kernel(LAYER, "prefill", dtype=torch.bfloat16)


def test_fp32_compiled_kernel_is_refused():
    with pytest.raises(InputError, match="float32"):
        sparsegen.get_kernel(LAYER, "prefill", dtype=torch.float32, arch="sm_90")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "half", None, 16, ["bf16"], {"fp16": 1}])
def test_bad_kernel_dtypes(dtype):
    for kind in ("prefill", "decode"):
        with pytest.raises(InputError, match="dtype"):
            sparsegen.get_kernel(LAYER, kind, dtype=dtype, arch="sm_90")


def test_nvrtc_warnings_are_errors():
    source = 'extern "C" __global__ void k(int *p) { int unused = 3; p[0] = 1; }'
    with pytest.raises(sparsegen.CompileError, match="warnings are errors"):
        nvrtc_build.compile_cubin(source, "sm_90", name="warn.cu")


@pytest.mark.parametrize(
    "constant",
    ["import os", "x; import os", "sm_90\n", "__half*", 1.5, None, b"fp16", {"a b": 1}, [object()]],
)
def test_unchecked_values_never_reach_a_template(constant):
    from sparsegen.jit import render

    with pytest.raises(sparsegen.CompileError, match="template constant"):
        render.render("prefill_triton.py.jinja", evil=constant)


def test_interpreter_pseudo_arch_is_prefill_only():
    with pytest.raises(ArchError, match="interpreter"):
        sparsegen.get_kernel(LAYER, "decode", dtype=torch.float16, arch="interpreter")
