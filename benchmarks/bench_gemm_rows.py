"""Few-row linears of Phi-3-Small 7b (a batch-32 decode step): cuBLAS against `models.gemm_rows` (GPU).

    PYTHONPATH=$PWD python3 benchmarks/bench_gemm_rows.py [--rows 32] [--shapes qkv,dense] [--out r.json]

For each 7b shape, bf16, `--rows` rows: microseconds per call inside a CUDA graph of 24 calls,
each on another copy of the weight ([out, in], >= 1.5 GB of copies in all, far above the L2), for
`F.linear` (cuBLAS) and for every tile of `models.gemm_rows` in SWEEP, launched with PDL (so
consecutive calls overlap as in a decode step), then the best tile again without PDL. Each
tile's result is checked against F.linear (relative error). The read rate counts weight bytes.
"""

from __future__ import annotations

import argparse
import json

import torch

from sparsegen.bench.common import graph_us

CALLS = 24
SHAPES = {"qkv": (6144, 4096), "dense": (4096, 4096), "up_proj": (28672, 4096), "down_proj": (4096, 14336),
          "lm_head": (100352, 4096)}  # fmt: skip
# name -> tiles (block_n, block_k, num_warps, stages); stages 0 = register prefetch
_SMALL_N = [
    (16, 256, 4, 0),
    (32, 128, 4, 0),
    (32, 256, 4, 0),
    (64, 128, 4, 0),
    (64, 256, 4, 0),
    (32, 128, 4, 4),
    (16, 256, 4, 4),
]
SWEEP = {
    "qkv": _SMALL_N,
    "dense": _SMALL_N,
    "up_proj": [(64, 128, 4, 0), (64, 256, 4, 0), (128, 128, 8, 0), (128, 128, 4, 0), (32, 256, 4, 0),
                (64, 128, 4, 3)],
    "down_proj": _SMALL_N[:6],
    "lm_head": [(64, 128, 4, 0), (128, 128, 8, 0), (64, 256, 4, 0), (64, 128, 4, 3)],
}  # fmt: skip


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_shape(name: str, rows: int, gen: torch.Generator) -> dict:
    from sparsegen.models.gemm_rows import gemm_rows

    n, k = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    copies = max(2, min(CALLS, -(-(3 << 29) // (n * k * 2))))
    ws = [(torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dt) for _ in range(copies)]
    b = None if name == "lm_head" else torch.randn(n, device=dev, generator=gen).to(dt)
    x = torch.randn(rows, k, device=dev, generator=gen).to(dt)
    want = torch.nn.functional.linear(x, ws[0], b)
    nbytes = n * k * 2

    def ours(i, tile, pdl=True):
        return gemm_rows(x, ws[i % copies], b, tile=tile, pdl=pdl)

    t_cublas = graph_us(lambda i: torch.nn.functional.linear(x, ws[i % copies], b), calls=CALLS)
    row = {"name": name, "n": n, "k": k, "rows": rows, "cublas_us": t_cublas,
           "cublas_tb_s": nbytes / t_cublas / 1e6, "sweep": []}  # fmt: skip
    print(
        f"{name} {n}x{k} rows {rows}: cuBLAS {t_cublas:.2f} us ({nbytes / t_cublas / 1e6:.2f} TB/s)",
        flush=True,
    )
    best = None
    for tile in SWEEP[name]:
        try:
            err = rel_err(ours(0, tile), want)
            t = graph_us(lambda i, tile=tile: ours(i, tile), calls=CALLS)
        except Exception as exc:  # noqa: BLE001 - a tile that fails to build or launch is reported and skipped
            print(f"  {tile}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        row["sweep"].append({"tile": tile, "us": t, "rel_err": err})
        print(f"  {tile}: {t:.2f} us ({nbytes / t / 1e6:.2f} TB/s), rel err {err:.1e}", flush=True)
        if best is None or t < best[0]:
            best = (t, tile)
    if best is not None:
        t_nopdl = graph_us(lambda i: ours(i, best[1], pdl=False), calls=CALLS)
        row.update(best_us=best[0], best_tile=best[1], best_nopdl_us=t_nopdl)
        print(
            f"  best {best[1]}: {best[0]:.2f} us with PDL, {t_nopdl:.2f} without; cuBLAS {t_cublas:.2f}",
            flush=True,
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm_rows needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        results.append(bench_shape(name, args.rows, gen))
        torch.cuda.empty_cache()
    print("== summary (us per call)")
    for r in results:
        print(f"{r['name']:10s} cuBLAS {r['cublas_us']:7.2f}  best {r.get('best_us', float('nan')):7.2f} "
              f"{r.get('best_tile')}  no PDL {r.get('best_nopdl_us', float('nan')):7.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
