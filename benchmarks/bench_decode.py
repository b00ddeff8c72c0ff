"""Paged decode on the Phi-3-Small sparse layer vs dense SDPA over the same KV, in one run.

    PYTHONPATH=$PWD python benchmarks/bench_decode.py --out decode.json

Per case (batch x context, bf16, 32 heads / 8 KV heads / d 128, page 16, shuffled pages):
dense SDPA over contiguous K/V of the same size, sparsegen's kernel (eager calls and CUDA-graph
replays), the device copy bandwidth measured here, and the floor: the KV bytes the union of each
KV group's heads needs, over that bandwidth. KV is GBs, far above L2, so no rotation is needed.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import sparsegen
from sparsegen.kernels.decode import num_splits
from sparsegen.layout import decode_pages
from sparsegen.testing import rel_err

CASES = ((64, 8192), (8, 32768), (1, 131072))


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def graph_time_us(fn, reps: int = 20) -> float:
    """Median time of one call, from replays of a graph holding `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3 / reps


def bench_case(layer, batch: int, ctx: int, page_size: int, bw: float) -> dict:
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    dt = torch.bfloat16
    pages_per_seq = ctx // page_size
    num_pages = batch * pages_per_seq
    k_cache = torch.randn(num_pages, page_size, hkv, d, device="cuda", dtype=dt)  # [pages, P, Hkv, D]
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_pages, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, device="cuda", dtype=dt)  # [B, H, D]
    scale = 1.0 / d
    kernel = sparsegen.get_kernel(layer, "decode", dtype=dt, page_size=page_size)

    def ours():
        return kernel(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)

    # Dense SDPA over contiguous K/V of the same size: [B, Hkv, ctx, D], GQA.
    kd = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=dt)
    vd = torch.randn_like(kd)
    qd = q.unsqueeze(2)  # [B, H, 1, D]

    def dense():
        return F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)

    ref = sparsegen.reference.paged_decode(
        q[:1].float(), k_cache.float(), v_cache.float(), block_tables[:1], seq_lens[:1], layer, scale
    )
    err = rel_err(ours()[:1], ref)
    needed = decode_pages(layer, ctx, page_size)  # [Hkv, pages]
    union_bytes = batch * int(needed.sum()) * page_size * d * 2 * 2  # K and V
    dense_bytes = batch * ctx * hkv * d * 2 * 2
    row = {
        "batch": batch,
        "context": ctx,
        "page_size": page_size,
        "dense_sdpa_us": do_bench(dense, warmup=25, rep=200, return_mode="median") * 1e3,
        "dense_sdpa_graph_us": graph_time_us(dense),
        "sparsegen_us": do_bench(ours, warmup=25, rep=200, return_mode="median") * 1e3,
        "sparsegen_graph_us": graph_time_us(ours),
        "floor_us": union_bytes / bw * 1e6,
        "dense_floor_us": dense_bytes / bw * 1e6,
        "union_fraction": union_bytes / dense_bytes,
        "rel_err_seq0": err,
        "splits": num_splits(
            batch * h // kernel.heads_per_block,
            pages_per_seq * page_size,
            torch.cuda.get_device_properties(0).multi_processor_count,
        ),
    }
    row["speedup_vs_dense"] = row["dense_sdpa_us"] / row["sparsegen_us"]
    row["sparsegen_repeat_us"] = do_bench(ours, warmup=25, rep=200, return_mode="median") * 1e3
    # Split-count sweep through the bare launch (no validation), to tune the heuristic.
    row["split_sweep_us"] = {}
    for s in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256):
        if s <= max(1, pages_per_seq * page_size // 64):
            fn = lambda s=s: kernel.launch(q, k_cache, v_cache, block_tables, seq_lens, scale, splits=s)  # noqa: E731
            row["split_sweep_us"][s] = do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    layer = sparsegen.get_pattern("phi3small").layers[0]
    bw = copy_bandwidth()
    rows = []
    for b, n in CASES:
        rows.append(bench_case(layer, b, n, args.page_size, bw))
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {result['device']}")
    print(
        f"{'B x ctx':>12} {'dense':>8} {'dense(g)':>9} {'ours':>8} {'ours(g)':>8} {'floor':>7} {'union':>6} {'x dense':>7} {'err':>8}"
    )
    for r in rows:
        print(
            f"{r['batch']:>4} x {r['context']:<6} {r['dense_sdpa_us']:8.1f} {r['dense_sdpa_graph_us']:9.1f} "
            f"{r['sparsegen_us']:8.1f} {r['sparsegen_graph_us']:8.1f} {r['floor_us']:7.1f} "
            f"{r['union_fraction']:6.3f} {r['speedup_vs_dense']:7.2f} {r['rel_err_seq0']:8.1e}"
        )
    for r in rows:
        best = min(r["split_sweep_us"], key=r["split_sweep_us"].get)
        print(
            f"{r['batch']} x {r['context']}: heuristic splits {r['splits']}, repeat {r['sparsegen_repeat_us']:.1f} us; "
            f"best {best} -> {r['split_sweep_us'][best]:.1f} us; sweep "
            + " ".join(f"{s}:{t:.0f}" for s, t in r["split_sweep_us"].items())
        )


if __name__ == "__main__":
    main()
