"""Paged decode over an fp8 (e4m3) KV cache against sparsegen's bf16 kernel, dense SDPA and the
fp8 byte floor, on the GPU, in one process.

    PYTHONPATH=$PWD python benchmarks/decode/bench_decode_fp8.py --out decode_fp8.json

Layers: Phi-3-Small's dense layer and its block-sparse layer (32 q / 8 KV heads, hd 128), bf16 q,
page 16, at 64 x 8K by default (issue 30's targets: fp8 >= 1.7x bf16 on the dense layer, >= 1.6x
on the sparse one, both >= 90 % of the fp8 byte floor). Per layer, interleaved in every round:
  fp8    the fp8 kernel (per-KV-head scales) over fp8 pages
  bf16   the bf16 kernel over bf16 pages of the same values
  sdpa   torch's scaled_dot_product_attention over contiguous bf16 K/V [B, Hkv, ctx, D] (GQA),
         the whole context (dense), as tune_decode.py times it
Time = CUDA-graph replays of 20 launches over a ring of cache copies at least 4x the L2
(commands.bench.common.graph_us), median of the rounds. Floors = the K/V bytes some head of
each group needs (layout.decode_pages) at 1 byte (fp8) or 2 (bf16) / this process's copy rate.
Each fp8 row also checks its output against the reference on the same fp8 bytes (first
sequence, float32) so that a fast wrong kernel shows.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import sparsegen
from sparsegen import reference
from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.kernels import decode as dec
from sparsegen.layout import decode_pages
from sparsegen.testing import row_errors

L2_BYTES = 60 << 20
FP8 = torch.float8_e4m3fn
PHI3 = sparsegen.get_pattern("phi3small")
LAYERS = {  # Phi-3-Small's two layer kinds: the first dense and the first block-sparse layer
    "dense": next(layer for layer in PHI3.layers if all(h.dense for h in layer.heads)),
    "sparse": next(layer for layer in PHI3.layers if not any(h.dense for h in layer.heads)),
}


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [pages, ps, Hkv, D] -> fp8 of x / scale[Hkv], saturated."""
    top = torch.finfo(FP8).max
    return (x.float() / scale[:, None]).clamp(-top, top).to(FP8)


def run_layer(name, layer, batch, ctx, page_size, bw, rounds) -> dict:
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    pages_per_seq = ctx // page_size
    pages = batch * pages_per_seq
    bytes_bf16 = 2 * pages * page_size * hkv * d * 2
    ring = max(1, -(-4 * L2_BYTES // (bytes_bf16 // 2)))  # the fp8 ring: each copy beyond the L2
    ks = torch.rand(hkv, device="cuda") * 0.02 + 0.005  # [Hkv] float32
    vs = torch.rand(hkv, device="cuda") * 0.02 + 0.005
    bf, f8 = [], []
    for _ in range(ring):
        k = torch.randn(pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k8, v8 = _quantize(k, ks), _quantize(v, vs)
        f8.append((k8, v8))
        if len(bf) < max(1, -(-4 * L2_BYTES // bytes_bf16)):
            bf.append(((k8.float() * ks[:, None]).bfloat16(), (v8.float() * vs[:, None]).bfloat16()))
        del k, v
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)  # [B, H, D]
    scale = d**-0.5
    k_fp8 = dec.get_decode_kernel(layer, dtype=torch.bfloat16, page_size=page_size, kv_dtype=FP8)
    k_bf16 = dec.get_decode_kernel(layer, dtype=torch.bfloat16, page_size=page_size)
    kd = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)  # dense SDPA's K/V
    vd = torch.randn_like(kd)
    qd = q.unsqueeze(2)  # [B, H, 1, D]

    fns = {
        "fp8": lambda i: k_fp8.launch(q, *f8[i % len(f8)], tables, lens, scale, k_scale=ks, v_scale=vs),
        "bf16": lambda i: k_bf16.launch(q, *bf[i % len(bf)], tables, lens, scale),
        "sdpa": lambda i: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True),
    }
    out = k_fp8.launch(q, *f8[0], tables, lens, scale, k_scale=ks, v_scale=vs)
    ref = reference.paged_decode(q[:1].float(), f8[0][0], f8[0][1], tables[:1], lens[:1], layer, scale,
                                 k_scale=ks, v_scale=vs)  # fmt: skip
    err = float(row_errors(out[:1], ref).max())
    times: dict[str, list[float]] = {r: [] for r in fns}
    for _ in range(rounds):
        for role, fn in fns.items():
            times[role].append(graph_us(fn))
    us = {r: statistics.median(t) for r, t in times.items()}
    needed = batch * int(decode_pages(layer, ctx, page_size).sum()) * page_size * d * 2  # K and V elements
    floors = {
        "fp8": needed * 1 / bw * 1e6,
        "bf16": needed * 2 / bw * 1e6,
        "sdpa": batch * ctx * hkv * d * 4 / bw * 1e6,
    }
    return {"layer": name, "batch": batch, "context": ctx, "page_size": page_size, "us": us, "floor_us": floors,
            "of_floor": {r: floors[r] / us[r] for r in us}, "fp8_vs_bf16": us["bf16"] / us["fp8"],
            "fp8_vs_sdpa": us["sdpa"] / us["fp8"], "fp8_max_rel_err_seq0": err, "fp8_kernel": k_fp8.name}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_fp8.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    bw = measure_ceilings().copy_tb_s * 1e12
    rows = []
    for name, layer in LAYERS.items():
        r = run_layer(name, layer, args.batch, args.context, args.page_size, bw, args.rounds)
        rows.append(r)
        torch.cuda.empty_cache()  # the layer's caches are gone with run_layer's frame
        print(f"{name:6s} fp8 {r['us']['fp8']:8.1f} us ({r['of_floor']['fp8']:.3f} of the fp8 floor)  "
              f"bf16 {r['us']['bf16']:8.1f} us ({r['of_floor']['bf16']:.3f})  sdpa {r['us']['sdpa']:8.1f} us  "
              f"fp8 / bf16 {r['fp8_vs_bf16']:.2f}x  err {r['fp8_max_rel_err_seq0']:.1e}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"copy_tb_s": bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
