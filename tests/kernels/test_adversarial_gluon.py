"""Bad input to the Gluon prefill path: typed errors, named, before anything runs (CPU tier)."""

from __future__ import annotations

import pytest
import torch
from helpers import extras

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import CompileError, ImplUnavailableError, InputError
from sparsegen.kernels import prefill_gluon_template as tpl
from sparsegen.kernels.prefill_gluon import get_gluon_prefill_kernel
from sparsegen.ops import get_kernel

extras.require_gluon()


def test_not_a_layer():
    with pytest.raises(InputError, match="LayerSpec"):
        get_gluon_prefill_kernel({"num_heads": 32}, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "bf17", None])
def test_bad_dtype(dtype):
    layer = sparsegen.get_pattern("phi3small").layers[0]
    with pytest.raises(InputError, match="dtype"):
        get_gluon_prefill_kernel(layer, dtype=dtype)


def test_uncovered_layer_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tl fallback compiles for sm_90 here
    narrow = HeadSpec(block_size=32, local_blocks=2, vert_stride=4)  # vertical blocks under 64 keys
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=96, heads=(narrow,) * 2)
    with pytest.raises(ImplUnavailableError, match="narrower than the 64-key tile"):
        get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90", variant="gluon")
    tl = get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90")  # the default falls back
    assert tl.request.variant == "tl"


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100"])
def test_gluon_variant_is_sm90_only(arch):
    layer = sparsegen.get_pattern("phi3small").layers[0]
    with pytest.raises(ImplUnavailableError, match="sm_90"):
        get_kernel(layer, "prefill", dtype=torch.bfloat16, arch=arch, variant="gluon")


def _aot_kernel_and_inputs(layer: LayerSpec, tokens: int = 5):
    """The layer's fp16 Gluon kernel built ahead of time, and zero q [T, H, D], k [T, Hkv, D] and
    cu_seqlens for one sequence; skips on a machine that can run the kernel."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine can run the kernel")
    kernel = get_kernel(layer, "prefill", dtype=torch.float16, arch="sm_90", variant="gluon")
    q = torch.zeros(tokens, layer.num_heads, layer.head_dim, dtype=torch.float16)
    k = torch.zeros(tokens, layer.num_kv_heads, layer.head_dim, dtype=torch.float16)
    return kernel, q, k, torch.tensor([0, tokens], dtype=torch.int32)


def test_aot_kernel_refuses_to_run_without_an_sm90_gpu():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(local_blocks=2),) * 2)
    kernel, q, k, cu = _aot_kernel_and_inputs(layer)
    with pytest.raises((InputError, ImplUnavailableError), match="CUDA|sm_90"):
        kernel(q, k, k, cu, cu, check=False)
    with pytest.raises(ImplUnavailableError, match="sm_90"):  # the launch itself refuses too
        kernel.launch(q, k, k, cu, cu, 0.125)
    with pytest.raises(InputError):  # shapes are checked before the device question
        kernel(q[:, :1], k, k, cu, cu)


def test_template_takes_typed_constants_only():
    layer = sparsegen.get_pattern("phi3small").layers[0]
    cfg = tpl.config(layer)
    cfg["stages"] = "3; import os"
    with pytest.raises(CompileError, match="stages"):
        tpl.render_source(layer, "bf16", cfg)


def test_hd96_bad_input_is_refused_before_launch():
    """Tensors at the padded width (128) are not a head_dim-96 layer's; on a machine without an
    sm_90 GPU the AOT kernel refuses to launch (typed errors, nothing runs)."""
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=96, heads=(HeadSpec(sliding_window=300),) * 4)
    kernel, q, k, cu = _aot_kernel_and_inputs(layer)
    wide_q, wide_k = torch.zeros(5, 4, 128, dtype=torch.float16), torch.zeros(5, 2, 128, dtype=torch.float16)
    with pytest.raises(InputError, match="q must be"):
        kernel(wide_q, k, k, cu, cu)
    with pytest.raises(InputError, match="k must be"):
        kernel(q, wide_k, wide_k, cu, cu)
    with pytest.raises(InputError, match="contiguous in its last dim"):
        kernel(q, k, torch.zeros(5, 2, 192, dtype=torch.float16)[..., ::2], cu, cu)
    with pytest.raises(ImplUnavailableError, match="sm_90"):
        kernel.launch(q, k, k, cu, cu, 0.1)
