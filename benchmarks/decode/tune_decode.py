"""Decode tuning aid (GPU): kernel variants and split sweeps vs dense SDPA, in one run.

    PYTHONPATH=$PWD python benchmarks/decode/tune_decode.py --out decode.json

Per case (batch x context, bf16, 32 heads / 8 KV heads / d 128, page 16, shuffled pages):
dense SDPA over contiguous K/V of the same size, sparsegen's kernel (eager calls and CUDA-graph
replays), the device copy bandwidth measured here, and the floor: the KV bytes the union of each
KV group's heads needs, over that bandwidth. KV is GBs, far above L2, so no rotation is needed.

Template variants (decode.get_decode_kernel knobs) are timed too, each with a split sweep through the
bare launch, and each checked against the reference on sequence 0 at two split counts.

    PYTHONPATH=$PWD python benchmarks/decode/tune_decode.py --merge-sweep [--out merge.json]

times only the split merges instead: at 1 x 8K, 32 x 8K and 1 x 128K, for a sparse (phi3small layer 0)
and a dense (layer 1) layer, us per launch (CUDA-graph replays) for each split count in
MERGE_SPLITS with the in-kernel (fused) merge and with the separate reduce kernel, and checks
that the two agree bitwise; decode_merge.FUSED_MAX_BYTES is set from it.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import sparsegen
from sparsegen.commands.bench.common import graph_us
from sparsegen.kernels import decode as dec
from sparsegen.layout import decode_pages
from sparsegen.testing import rel_err

CASES = ((64, 8192), (8, 32768), (1, 131072))
# name -> template knobs; "default" is what get_kernel builds (decode_template.DEFAULT_KNOBS).
VARIANTS = {
    "default": None,
    "p1_qsmem_b3": {"pipeline": 1, "min_blocks": 3, "q_smem": 1},
    "p0_qsmem_b5": {"pipeline": 0, "min_blocks": 5, "q_smem": 1},
    "no_fused_merge": {"fused_merge": 0},  # the kernel as before the in-kernel merge
}
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MERGE_CASES = ((1, 8192), (32, 8192), (1, 131072))
MERGE_SPLITS = (2, 8, 16, 32, 48, 64)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def graph_time_us(fn) -> float:
    """Microseconds per fn() call, from replays of a CUDA graph holding 20 calls."""
    return graph_us(lambda _i: fn())


def bench_case(layer, kernels: dict, batch: int, ctx: int, page_size: int, bw: float) -> dict:
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
    kernel = kernels["default"]
    rows = batch * h // kernel.heads_per_block
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heuristic = dec.num_splits(rows, pages_per_seq * page_size, sms)

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
        "rel_err_seq0": rel_err(ours()[:1], ref),
        "splits": heuristic,
    }
    row["speedup_vs_dense"] = row["dense_sdpa_us"] / row["sparsegen_us"]
    row["speedup_vs_dense_graph"] = row["dense_sdpa_graph_us"] / row["sparsegen_graph_us"]
    row["sparsegen_repeat_us"] = do_bench(ours, warmup=25, rep=200, return_mode="median") * 1e3
    # Per variant: rel_err at the heuristic split and at 1 split, and a split sweep (bare launch).
    row["variants"] = {}
    chunks = -(-ctx // dec.TILE)
    for name, kern in kernels.items():

        def launch(s, kern=kern):
            return kern.launch(q, k_cache, v_cache, block_tables, seq_lens, scale, splits=s)

        v = {
            "rel_err_heuristic": rel_err(launch(heuristic)[:1], ref),
            "rel_err_1split": rel_err(launch(1)[:1], ref),
            "graph_us_heuristic": graph_time_us(lambda: launch(heuristic)),  # noqa: B023
            "sweep_us": {},
        }
        for s in SPLITS:
            if s <= max(1, chunks // 2) and rows * s <= 40000:
                v["sweep_us"][s] = (
                    do_bench(lambda s=s: launch(s), warmup=10, rep=100, return_mode="median") * 1e3
                )
        best = min(v["sweep_us"], key=v["sweep_us"].get)
        v["best_splits"], v["best_us"] = best, v["sweep_us"][best]
        v["graph_us_best"] = graph_time_us(lambda best=best: launch(best))
        row["variants"][name] = v
    return row


def merge_case(kernel, plain, layer, batch: int, ctx: int, page_size: int, sms: int) -> dict:
    """One (layer, batch x context): graph us of every split count in MERGE_SPLITS, both merges;
    and at 1 split and 2 split-separate, the default build vs `plain` (built with fused_merge=0,
    i.e. without the merge's code) to show that the fused merge costs the other paths nothing."""
    from sparsegen.kernels.decode_merge import use_fused

    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    pages = ctx // page_size
    k_cache = torch.randn(batch * pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)  # [pages, P, Hkv, D]
    tables = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)  # [B, H, D]
    groups = h // kernel.heads_per_block
    row = {"batch": batch, "context": ctx, "heuristic": dec.num_splits(batch * groups, ctx, sms),
           "fused_us": {}, "separate_us": {}, "bitwise_equal": {}, "rule_fused": {}}  # fmt: skip

    def launch(_i, splits, merge, kern=kernel):
        return kern.launch(q, k_cache, v_cache, tables, lens, 1 / d, splits=splits, merge=merge)

    for name, kern in (("default", kernel), ("fused_merge0", plain)):
        row[f"1split_us_{name}"] = graph_us(functools.partial(launch, splits=1, merge=None, kern=kern))
        row[f"2split_separate_us_{name}"] = graph_us(
            functools.partial(launch, splits=2, merge="separate", kern=kern)
        )

    for s in MERGE_SPLITS:
        outs = {}
        for merge in ("fused", "separate"):
            outs[merge] = launch(0, s, merge)
            row[f"{merge}_us"][s] = graph_us(functools.partial(launch, splits=s, merge=merge))
        row["bitwise_equal"][s] = bool(torch.equal(outs["fused"], outs["separate"]))
        row["rule_fused"][s] = use_fused(s, kernel.heads_per_block, d)
    return row


def merge_sweep(page_size: int) -> list[dict]:
    """Fused vs separate split merge, per (layer kind, case, splits): graph us and bitwise agreement."""
    from sparsegen.kernels.decode_merge import FUSED_MAX_BYTES

    spec = sparsegen.get_pattern("phi3small")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for kind, layer in (("sparse", spec.layers[0]), ("dense", spec.layers[1])):
        kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=page_size)
        plain = dec.get_decode_kernel(
            layer, dtype=torch.bfloat16, page_size=page_size, knobs={"fused_merge": 0}
        )
        for batch, ctx in MERGE_CASES:
            rows.append({"kind": kind, **merge_case(kernel, plain, layer, batch, ctx, page_size, sms)})
            torch.cuda.empty_cache()
    print(f"split merge, us per launch (CUDA-graph replays), cells fused/separate; FUSED_MAX_BYTES = "
          f"{FUSED_MAX_BYTES} (* = the rule picks fused; ! = fused and separate outputs differ bitwise)")  # fmt: skip
    print(f"{'layer':>6} {'B x ctx':>9} {'pick':>4}  " + " ".join(f"{s:>15}" for s in MERGE_SPLITS))
    for r in rows:
        cells = []
        for s in MERGE_SPLITS:
            mark = ("*" if r["rule_fused"][s] else " ") + (" " if r["bitwise_equal"][s] else "!")
            cells.append(f"{r['fused_us'][s]:6.1f}/{r['separate_us'][s]:6.1f}{mark}")
        print(f"{r['kind']:>6} {r['batch']:>3} x {r['context']:<5} {r['heuristic']:>4}  " + " ".join(cells))
    print("without the fused merge's code (fused_merge=0 build) vs the default build, us per launch:")
    for r in rows:
        print(f"{r['kind']:>6} {r['batch']:>3} x {r['context']:<5} 1 split {r['1split_us_fused_merge0']:6.1f} vs "
              f"{r['1split_us_default']:6.1f}; 2 splits separate {r['2split_separate_us_fused_merge0']:6.1f} vs "
              f"{r['2split_separate_us_default']:6.1f}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--merge-sweep", action="store_true", help="only time fused vs separate split merges")
    args = ap.parse_args()
    if args.merge_sweep:
        rows = merge_sweep(args.page_size)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "merge_sweep": rows}, f, indent=1)
        return
    t0 = time.time()
    layer = sparsegen.get_pattern("phi3small").layers[0]
    dt = torch.bfloat16
    kernels = {}
    for name, knobs in VARIANTS.items():
        if name not in args.variants:
            continue
        if knobs is None:
            kernels[name] = sparsegen.get_kernel(layer, "decode", dtype=dt, page_size=args.page_size)
        else:
            kernels[name] = dec.get_decode_kernel(layer, dtype=dt, page_size=args.page_size, knobs=knobs)
    bw = copy_bandwidth()
    rows = []
    for b, n in CASES:
        rows.append(bench_case(layer, kernels, b, n, args.page_size, bw))
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # partial results survive a timeout
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_bandwidth_TBps": bw / 1e12,
                    "rows": rows,
                    "default_knobs": dec.DEFAULT_KNOBS,
                    "variants": VARIANTS,
                },
                f,
                indent=1,
            )
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name()}; {time.time() - t0:.0f} s")
    for r in rows:
        for name, v in r["variants"].items():
            print(
                f"{r['batch']}x{r['context']} {name:>12}: err {v['rel_err_heuristic']:.1e}/{v['rel_err_1split']:.1e} "
                f"graph@{r['splits']} {v['graph_us_heuristic']:.1f} best {v['best_splits']}:{v['best_us']:.1f} "
                f"(graph {v['graph_us_best']:.1f}) sweep "
                + " ".join(f"{s}:{t:.0f}" for s, t in v["sweep_us"].items())
            )
    print(
        f"{'B x ctx':>12} {'dense':>8} {'dense(g)':>9} {'ours':>8} {'ours(g)':>8} {'floor':>7} {'union':>6} "
        f"{'x dense':>7} {'splits':>6} {'err':>8}"
    )
    for r in rows:
        print(
            f"{r['batch']:>4} x {r['context']:<6} {r['dense_sdpa_us']:8.1f} {r['dense_sdpa_graph_us']:9.1f} "
            f"{r['sparsegen_us']:8.1f} {r['sparsegen_graph_us']:8.1f} {r['floor_us']:7.1f} "
            f"{r['union_fraction']:6.3f} {r['speedup_vs_dense']:7.2f} {r['splits']:>6} {r['rel_err_seq0']:8.1e}"
        )


if __name__ == "__main__":
    main()
