"""Paged decode against the KV-cache layout and the kernel's load variants (GPU), in one process.

    PYTHONPATH=$PWD python benchmarks/decode/bench_decode_layout.py --out decode_layout.json
    PYTHONPATH=$PWD python benchmarks/decode/bench_decode_layout.py --layouts head --pages 16 \
        --variants default,pipe1

The kernel takes the cache's strides, so one build serves two layouts of the same
[num_pages, page_size, Hkv, D] view:
  token-major  (the engine's today): a page is page_size rows of all Hkv heads; one KV head's
               part of a page is page_size runs of 256 bytes, 2 KB apart (Phi-3-Small);
  head-major   a [num_pages, Hkv, page_size, D] buffer seen through .transpose(1, 2): one KV
               head's part of a page is one contiguous run (4 KB at page 16).
Each layout is timed at page 16 and 32 with each template variant of VARIANTS (decode.
get_decode_kernel knobs). Session 7 also timed two K/V load flavours and a cp.async ring this way
(docs/performance.md); both lost and were removed. Cases are
Phi-3-Small's sparse (layer 0) and dense (layer 1) layers at the engine's decode shapes. Time =
CUDA-graph replays of 20 launches over a ring of cache copies at least 4x the L2 in size, median
of 3 interleaved rounds; floor = the KV bytes some head of each group needs / the copy rate of
this process. Every variant's output is compared with the default's on the same data.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import sparsegen
from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.kernels import decode as dec
from sparsegen.layout import decode_pages
from sparsegen.testing import rel_err

CASES = ((32, 8192), (64, 8192), (1, 8192), (1, 131072))
VARIANTS = {  # name: decode template knobs; "default" is what get_kernel builds
    "default": {},
    "pipe1": {"pipeline": 1, "min_blocks": 3},  # the next tile's loads before this tile's math
    "qk1": {"qk_accs": 1},  # the QK k-steps in one chain of mma (the default before session 9)
    "qk4": {"qk_accs": 4},  # in four (the default: two)
    # not yet timed: 5 / 6 blocks per SM with q in shared memory (dense layer: 96 registers and
    # no spills / 80 registers and 96 B of spills; the sparse layer spills 88 / 600 B)
    "b5q": {"min_blocks": 5, "q_smem": 1},
    "b6q": {"min_blocks": 6, "q_smem": 1},
}
LAYOUTS = ("token", "head")
PAGES = (16, 32)
L2_BYTES = 60 << 20


def copy_rate() -> float:
    """Bytes/s of a device-to-device copy (read + written), timed outside a graph: session 7's
    first run timed it inside one, where the copy ran as a memcpy node at 2.7 TB/s."""
    return measure_ceilings().copy_tb_s * 1e12


def make_caches(layout: str, pages: int, page_size: int, hkv: int, d: int, ring: int):
    """`ring` (k, v) pairs, each [pages, page_size, Hkv, D] in the given memory layout."""
    out = []
    for _ in range(ring):
        pair = []
        for _kv in range(2):
            if layout == "token":
                t = torch.randn(pages, page_size, hkv, d, device="cuda", dtype=torch.bfloat16)
            else:
                t = torch.randn(pages, hkv, page_size, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            pair.append(t)
        out.append(tuple(pair))
    return out


def run_case(kind, layer, kernels, batch, ctx, page_size, bw, rounds, layouts) -> dict:
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    pages_per_seq = ctx // page_size
    pages = batch * pages_per_seq
    bytes_one = 2 * pages * page_size * hkv * d * 2
    ring = max(1, -(-4 * L2_BYTES // bytes_one))
    tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, pages_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)  # [B, H, D]
    needed = decode_pages(layer, ctx, page_size)  # [Hkv, pages]
    floor_us = batch * int(needed.sum()) * page_size * d * 2 * 2 / bw * 1e6
    caches = {lay: make_caches(lay, pages, page_size, hkv, d, ring) for lay in layouts}
    first = caches[layouts[0]]
    for lay in layouts[1:]:  # the same values in every layout: one baseline for every output
        for (k0, v0), (k1, v1) in zip(first, caches[lay]):
            k1.copy_(k0)
            v1.copy_(v0)
    base = kernels["default"].launch(q, *first[0], tables, lens, 1 / d)
    times: dict[str, list[float]] = {}
    errs: dict[str, float] = {}
    for _ in range(rounds):
        for lay in layouts:
            for vname, kern in kernels.items():
                name = f"{lay}_{vname}"

                def fn(i, kern=kern, lay=lay):
                    k, v = caches[lay][i % ring]
                    return kern.launch(q, k, v, tables, lens, 1 / d)

                times.setdefault(name, []).append(graph_us(fn))
                errs[name] = rel_err(fn(0).float(), base.float())
    row = {"kind": kind, "batch": batch, "context": ctx, "page_size": page_size, "ring": ring,
           "floor_us": floor_us, "us": {}, "of_floor": {}, "rel_err_vs_default": errs}  # fmt: skip
    for name, ts in times.items():
        row["us"][name] = statistics.median(ts)
        row["of_floor"][name] = row["us"][name] / floor_us
    caches.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_layout.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--pages", default=",".join(map(str, PAGES)))
    args = ap.parse_args()
    names = args.variants.split(",")
    layouts = args.layouts.split(",")
    if "default" not in names or not set(names) <= set(VARIANTS) or not set(layouts) <= set(LAYOUTS):
        raise SystemExit(f"--variants: names of {list(VARIANTS)} with default; --layouts: of {LAYOUTS}")
    spec = sparsegen.get_pattern("phi3small")
    bw = copy_rate()
    rows = []
    for page_size in (int(p) for p in args.pages.split(",")):
        for kind, layer in (("sparse", spec.layers[0]), ("dense", spec.layers[1])):
            kernels = {
                n: dec.get_decode_kernel(layer, dtype=torch.bfloat16, page_size=page_size, knobs=VARIANTS[n])
                for n in names
            }
            for batch, ctx in CASES:
                if kind == "dense" and ctx > 8192:
                    continue
                r = run_case(kind, layer, kernels, batch, ctx, page_size, bw, args.rounds, layouts)
                rows.append(r)
                cells = " ".join(f"{n} {u:7.1f} ({r['of_floor'][n]:.3f})" for n, u in r["us"].items())
                print(f"ps{page_size} {kind:>6} {batch:>3}x{ctx:<6} floor {r['floor_us']:7.1f} us | {cells}",
                      flush=True)  # fmt: skip
                bad = {n: e for n, e in r["rel_err_vs_default"].items() if not e < 1e-2}
                if bad:
                    print(f"  MISMATCH vs the default: {bad}")
    with open(args.out, "w") as f:
        json.dump({"copy_rate_Bps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
