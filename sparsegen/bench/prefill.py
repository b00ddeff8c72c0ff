"""Prefill benchmark: sparsegen's Triton kernel vs dense causal SDPA and FlexAttention.

Batch 1, bf16. The floor is the useful FLOPs (4 * D * visible pairs, summed over heads) at
the matmul rate measured in the same run.
"""

from __future__ import annotations

import torch

from .. import ops
from ..layout import density
from ..spec import LayerSpec
from .common import Ceilings, flex_mask_mod, median_ms


def visible_pairs(layer: LayerSpec, seq_len: int) -> float:
    causal = seq_len * (seq_len + 1) / 2
    return float(density(layer, seq_len).sum()) * causal


def bench_case(layer: LayerSpec, seq_len: int, ceilings: Ceilings, *, flex: bool = True) -> dict:
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    gen = torch.Generator(device="cuda").manual_seed(seq_len)
    q = torch.randn(seq_len, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # q: [S, H, D]
    k = torch.randn(seq_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # k: [S, Hkv, D]
    v = torch.randn(seq_len, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    ops.prefill(q, k, v, cu, cu, layer, impl="triton")  # compile/load outside the timing
    row = {"seq_len": seq_len}
    row["sparsegen_ms"] = median_ms(lambda: ops.prefill(q, k, v, cu, cu, layer, impl="triton"))

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H|Hkv, S, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_dense_ms"] = median_ms(lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True))
    if flex:
        row["flex_ms"] = _flex_ms(layer, qt, kt, vt, seq_len)
    pairs = visible_pairs(layer, seq_len)
    row["floor_ms"] = 4 * d * pairs / (ceilings.matmul_tflop_s * 1e12) * 1e3
    row["useful_tflop_s"] = 4 * d * pairs / (row["sparsegen_ms"] * 1e-3) / 1e12
    return row


def _flex_ms(layer: LayerSpec, qt, kt, vt, seq_len: int) -> float:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod = flex_mask_mod(layer, seq_len, seq_len, "cuda")
    block_mask = create_block_mask(mask_mod, None, layer.num_heads, seq_len, seq_len, device="cuda")
    flex = torch.compile(flex_attention)
    flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)
    return median_ms(lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True))
