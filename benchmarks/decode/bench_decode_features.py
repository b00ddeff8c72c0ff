"""Paged decode with the attention features of issue 29 against the same layer without them, and
head_dim 256 against its read floor (GPU), in one process.

    PYTHONPATH=$PWD python benchmarks/decode/bench_decode_features.py --out decode_features.json

Pairs (feature layer, the same layer without the feature), bf16, page 16, at 64 x 8K:
  hd256_dense      Gemma-2's global layer shape (16 q / 8 KV heads, hd 256), no feature: the read floor
  softcap          the same layer with logit_softcap 50 (cost against hd256_dense)
  learned_sinks    gpt-oss's window layer (64 q / 8 KV heads, hd 64, window 128) with / without sinks
  sink_tokens      the same window layer with 4 sink tokens / without
Time = CUDA-graph replays of 20 launches over a ring of cache copies at least 4x the L2 (graph_us),
median of interleaved rounds; floor = the KV bytes some head of each group needs / this process's
copy rate. The ratio is feature / base from the same rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from sparsegen import HeadSpec, LayerSpec
from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.kernels import decode as dec
from sparsegen.layout import decode_pages

L2_BYTES = 60 << 20
GEMMA_GLOBAL = LayerSpec(16, 8, 256, (HeadSpec(dense=True),) * 16)
GPT_OSS_WINDOW = LayerSpec(64, 8, 64, (HeadSpec(block_size=16, sliding_window=128),) * 64)
PAIRS = {  # name: (layer with the feature, layer without it)
    "hd256_dense": (GEMMA_GLOBAL, GEMMA_GLOBAL),
    "softcap": (dataclasses.replace(GEMMA_GLOBAL, logit_softcap=50.0), GEMMA_GLOBAL),
    "learned_sinks": (dataclasses.replace(GPT_OSS_WINDOW, learned_sinks=True), GPT_OSS_WINDOW),
    "sink_tokens": (LayerSpec(64, 8, 64, (HeadSpec(block_size=16, sliding_window=128, sink_tokens=4),) * 64),
                    GPT_OSS_WINDOW),
}  # fmt: skip


def run_pair(name, layer, base, batch, ctx, page_size, bw, rounds) -> dict:
    hkv, d = layer.num_kv_heads, layer.head_dim
    pages_per_seq = ctx // page_size
    pages = batch * pages_per_seq
    bytes_one = 2 * pages * page_size * hkv * d * 2
    ring = max(1, -(-4 * L2_BYTES // bytes_one))
    caches = [tuple(torch.randn(pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(ring)]  # fmt: skip
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, layer.num_heads, d, device="cuda", dtype=torch.bfloat16)  # [B, H, D]
    sinks = torch.randn(layer.num_heads, device="cuda")  # [H] float32
    floors = {}
    times: dict[str, list[float]] = {"feature": [], "base": []}
    kernels = {}
    for role, lay in (("feature", layer), ("base", base)):
        kernels[role] = dec.get_decode_kernel(lay, dtype=torch.bfloat16, page_size=page_size)
        floors[role] = batch * int(decode_pages(lay, ctx, page_size).sum()) * page_size * d * 2 * 2 / bw * 1e6
    for _ in range(rounds):
        for role, lay in (("feature", layer), ("base", base)):
            kern, s = kernels[role], (sinks if lay.learned_sinks else None)

            def fn(i, kern=kern, s=s):
                k, v = caches[i % ring]
                return kern.launch(q, k, v, tables, lens, 1 / d**0.5, sinks=s)

            times[role].append(graph_us(fn))
    us = {r: statistics.median(t) for r, t in times.items()}
    caches.clear()
    torch.cuda.empty_cache()
    return {"case": name, "batch": batch, "context": ctx, "page_size": page_size, "us": us,
            "floor_us": floors, "of_floor": {r: floors[r] / us[r] for r in us},
            "cost": us["feature"] / us["base"] - 1.0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_features.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    bw = measure_ceilings().copy_tb_s * 1e12
    rows = []
    for name, (layer, base) in PAIRS.items():
        r = run_pair(name, layer, base, args.batch, args.context, 16, bw, args.rounds)
        rows.append(r)
        print(f"{name:14s} feature {r['us']['feature']:8.1f} us ({r['of_floor']['feature']:.3f} of floor)  "
              f"base {r['us']['base']:8.1f} us  cost {100 * r['cost']:+.1f} %")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"copy_tb_s": bw / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
