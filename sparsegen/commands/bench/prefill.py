"""Prefill benchmark: sparsegen's Triton kernel vs dense causal SDPA and FlexAttention.

Batch 1, bf16. Three sparsegen times: the kernel alone (`check=False`: no host read of
cu_seqlens), the public `sparsegen.prefill` (validates cu_seqlens on the host first, one device
sync) and the public call given `max_seqlen_q/k` (no sync). `variant` is the kernel used
("gluon" on sm_90 where it covers the layer, else "tl"). The
floor is the useful FLOPs (4 * D * visible pairs, summed over heads) at the matmul rate
measured in the same run. sparsegen's output is checked against FlexAttention's.
"""

from __future__ import annotations

import torch

from ... import flex as sg_flex
from ... import ops
from ...kernels.prefill import get_prefill_kernel
from ...layout import density
from ...spec import LayerSpec
from ...testing import rel_err
from .common import Ceilings, median_ms


def visible_pairs(layer: LayerSpec, seq_len: int) -> float:
    causal = seq_len * (seq_len + 1) / 2
    return float(density(layer, seq_len).sum()) * causal


def inputs(layer: LayerSpec, seq_len: int, dtype=torch.bfloat16):
    """Random q [S, H, D], k and v [S, Hkv, D], and cu_seqlens [0, S] on the GPU."""
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    gen = torch.Generator(device="cuda").manual_seed(seq_len)
    q = torch.randn(seq_len, h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(seq_len, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(seq_len, hkv, d, device="cuda", dtype=dtype, generator=gen)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def bench_case(layer: LayerSpec, seq_len: int, ceilings: Ceilings, *, flex: bool = True) -> dict:
    q, k, v, cu = inputs(layer, seq_len)
    kernel = get_prefill_kernel(layer, dtype=torch.bfloat16)  # compile/load outside the timing
    out = kernel(q, k, v, cu, cu)
    row: dict = {"seq_len": seq_len}
    row["sparsegen_ms"] = median_ms(lambda: kernel(q, k, v, cu, cu, check=False))
    row["sparsegen_api_ms"] = median_ms(lambda: ops.prefill(q, k, v, cu, cu, layer, impl="triton"))
    row["sparsegen_api_max_seqlen_ms"] = median_ms(
        lambda: ops.prefill(q, k, v, cu, cu, layer, impl="triton", max_seqlen_q=seq_len, max_seqlen_k=seq_len)
    )
    row["variant"] = kernel.request.variant
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H|Hkv, S, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_dense_ms"] = median_ms(lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True))
    if flex:
        try:
            ms, flex_out = _flex(layer, qt, kt, vt, seq_len)
            row["flex_ms"] = ms
            row["rel_err_vs_flex"] = rel_err(out, flex_out[0].transpose(0, 1))
        except Exception as exc:  # noqa: BLE001 - the other columns still count
            row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    pairs = visible_pairs(layer, seq_len)
    row["floor_ms"] = 4 * layer.head_dim * pairs / (ceilings.matmul_tflop_s * 1e12) * 1e3
    row["useful_tflop_s"] = 4 * layer.head_dim * pairs / (row["sparsegen_ms"] * 1e-3) / 1e12
    return row


def _flex(layer: LayerSpec, qt, kt, vt, seq_len: int):
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = sg_flex.block_mask(layer, seq_len, seq_len, device="cuda", compile=True)
    flex = torch.compile(flex_attention)
    out = flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)
    return median_ms(lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)), out
