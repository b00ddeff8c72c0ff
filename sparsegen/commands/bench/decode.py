"""Decode benchmark: sparsegen's paged CUDA kernel vs dense SDPA and FlexAttention decode.

bf16, page size 16, shuffled page tables. Every variant is timed as CUDA-graph replays when
it can be captured. The floor is the KV bytes that must be read (for each KV head, the union
of the keys its query heads see, K and V) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import torch

from ... import flex as sg_flex
from ... import ops
from ...layout import layer_visible
from ...spec import LayerSpec
from .common import Ceilings, median_ms_graph

PAGE_SIZE = 16


def union_kv_tokens(layer: LayerSpec, seq_len: int) -> int:
    """Keys summed over KV heads that some query head of the group sees at position seq_len-1."""
    vis = layer_visible(layer, torch.tensor([seq_len - 1]), torch.arange(seq_len))[:, 0]  # [H, S]
    return int(vis.view(layer.num_kv_heads, layer.group_size, seq_len).any(1).sum())


def bench_case(layer: LayerSpec, batch: int, seq_len: int, ceilings: Ceilings, *, flex: bool = True) -> dict:
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    gen = torch.Generator(device="cuda").manual_seed(batch * seq_len)
    pages_per_seq = -(-seq_len // PAGE_SIZE)
    num_pages = batch * pages_per_seq
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # q: [B, H, D]
    # k_cache, v_cache: [num_pages, page_size, Hkv, D]
    k_cache = torch.randn(num_pages, PAGE_SIZE, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(num_pages, PAGE_SIZE, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    block_tables = perm.view(batch, pages_per_seq)  # [B, max_pages], shuffled pages
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")

    def run():
        return ops.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, impl="cuda")

    run()
    row = {"batch": batch, "seq_len": seq_len}
    ms, captured = median_ms_graph(run)
    row["sparsegen_us"], row["sparsegen_graph"] = ms * 1e3, captured

    # Dense baselines read contiguous KV: [B, Hkv, S, D]
    kc = k_cache[block_tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
    vc = v_cache[block_tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
    qd = q.unsqueeze(2)  # [B, H, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_dense_us"] = median_ms_graph(lambda: sdpa(qd, kc, vc, enable_gqa=True))[0] * 1e3
    if flex:
        row["flex_us"] = _flex_us(layer, qd, kc, vc, seq_len)
    kv_bytes = batch * union_kv_tokens(layer, seq_len) * d * 2 * k_cache.element_size()
    row["floor_us"] = kv_bytes / (ceilings.copy_tb_s * 1e12) * 1e6
    row["achieved_tb_s"] = kv_bytes / (row["sparsegen_us"] * 1e-6) / 1e12
    return row


def _flex_us(layer: LayerSpec, qd, kc, vc, seq_len: int) -> float:
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = sg_flex.block_mask(layer, 1, seq_len, device="cuda")
    flex = torch.compile(flex_attention)
    flex(qd, kc, vc, block_mask=block_mask, enable_gqa=True)
    return median_ms_graph(lambda: flex(qd, kc, vc, block_mask=block_mask, enable_gqa=True))[0] * 1e3
