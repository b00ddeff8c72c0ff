"""Prefill benchmark: sparsegen's Triton kernel vs its peers (`peers.py`: SDPA, FlexAttention's
Triton and FLASH backends, FlashAttention-4) on the cases of `cases.py`.

Batch 1, bf16. Three sparsegen times: the kernel alone (`check=False`: no host read of
cu_seqlens), the public `sparsegen.prefill` (validates cu_seqlens on the host first, one device
sync) and the public call given `max_seqlen_q/k` (no sync). `variant` is the kernel used
("gluon" on sm_90 where it covers the layer, else "tl"); where it is not "tl", `tl_ms` times the
tl kernel too. The floor is the useful FLOPs (4 * D * visible pairs, summed over heads) at the
matmul rate measured in the same run. sparsegen's output is checked against every peer that ran
(`rel_err_vs_<peer>`). `sdpa_dense_ms` is dense causal SDPA on the same shapes for every case: a
reference point, a peer only for a dense layer.
"""

from __future__ import annotations

import torch

from ... import flex as sg_flex
from ... import ops
from ...kernels.prefill import get_prefill_kernel
from ...layout import density
from ...spec import LayerSpec
from ...testing import rel_err
from . import peers
from .cases import PEERS, is_time, summarize
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
    gen = torch.Generator(device="cuda").manual_seed(seq_len + 1)
    sinks = (
        torch.randn(layer.num_heads, device="cuda", generator=gen) if layer.learned_sinks else None
    )  # [H] fp32
    extra = {} if sinks is None else {"sinks": sinks}
    kernel = get_prefill_kernel(layer, dtype=torch.bfloat16)  # compile/load outside the timing
    out = kernel(q, k, v, cu, cu, **extra)
    row: dict = {"seq_len": seq_len, "variant": kernel.request.variant}
    row["sparsegen_ms"] = median_ms(lambda: kernel(q, k, v, cu, cu, check=False, **extra))
    row["sparsegen_api_ms"] = median_ms(lambda: ops.prefill(q, k, v, cu, cu, layer, impl="triton", **extra))
    row["sparsegen_api_max_seqlen_ms"] = median_ms(
        lambda: ops.prefill(
            q, k, v, cu, cu, layer, impl="triton", max_seqlen_q=seq_len, max_seqlen_k=seq_len, **extra
        )
    )
    if row["variant"] != "tl":
        tl = get_prefill_kernel(layer, dtype=torch.bfloat16, variant="tl")
        tl(q, k, v, cu, cu, **extra)
        row["tl_ms"] = median_ms(lambda: tl(q, k, v, cu, cu, check=False, **extra))
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H|Hkv, S, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_dense_ms"] = median_ms(lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True))
    skipped = "n/a (FlexAttention skipped: --no-flex or above --flex-max-seq-len)"
    results = {"sdpa": peers.time_sdpa(layer, q, k, v), "fa4": peers.time_fa4(layer, q, k, v, sinks)}
    if flex:
        block_mask = sg_flex.block_mask(layer, seq_len, seq_len, device="cuda", compile=True)
        for name, backend in (("flex", "TRITON"), ("flex_flash", "FLASH")):
            results[name] = peers.time_flex(layer, q, k, v, sinks, backend=backend, block_mask=block_mask)
            torch.cuda.empty_cache()
    else:
        results["flex"] = (skipped, None)
        fa4 = peers.fa4_module()  # the FLASH backend is FA4's kernels: not installed says so first
        results["flex_flash"] = (fa4 if isinstance(fa4, str) else skipped, None)
    row["peers"] = {name: results[name][0] for name in PEERS}
    for name in PEERS:
        if results[name][1] is not None:
            row[f"rel_err_vs_{name}"] = rel_err(out, results[name][1])
    if is_time(row["peers"]["flex"]):  # the names of earlier runs' JSON
        row["flex_ms"] = row["peers"]["flex"]
    pairs = visible_pairs(layer, seq_len)
    row["floor_ms"] = 4 * layer.head_dim * pairs / (ceilings.matmul_tflop_s * 1e12) * 1e3
    row["useful_tflop_s"] = 4 * layer.head_dim * pairs / (row["sparsegen_ms"] * 1e-3) / 1e12
    return summarize(row)
