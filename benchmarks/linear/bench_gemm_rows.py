"""Few-row linear layers of Phi-3-Small 7b: cuBLAS (`F.linear`) against `kernels.linear.gemm_rows` (GPU).

    PYTHONPATH=$PWD python3 benchmarks/linear/bench_gemm_rows.py [--rows 32] [--sweep] [--out f.json]
    PYTHONPATH=$PWD python3 benchmarks/linear/bench_gemm_rows.py --diag    # occupancy, loads-only times
    PYTHONPATH=$PWD python3 benchmarks/linear/bench_gemm_rows.py --rope    # decode QKV + rotary + K/V write

For each 7b decode linear (qkv, dense, up_proj, down_proj), bf16, `--rows` rows of x: the time
of one call inside a CUDA graph of 24 calls, each call on another copy of the weight (copies
>= 4x the L2, as in a decode step where 32 layers' weights stream through), for cuBLAS and for
gemm_rows with and without programmatic dependent launch (PDL: each call's first W tiles load
while the call before it ends, as in the model's chain of kernels). Every build's output is
checked against the float64 product first (rel err, into a NaN-filled output). `--sweep` also
times the tiles of SWEEP. Floor = the weight's bytes at this process's copy rate. `--diag`
times the DIAG tiles with their math and without it (`Build.skip_mma`) and prints the driver's
blocks per SM and how many clusters fit at once; `--rope` times the QKV kernel with the rotary
and K/V cache write against cuBLAS followed by `fused.rotary_qkv` (ROPE_TILES).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.kernels.linear import gemm_rows as gr
from sparsegen.kernels.linear.gemm_rows_tiles import Tile, tile_for

CALLS = 24
L2_BYTES = 60 << 20
SHAPES = (("qkv", 6144, 4096), ("dense", 4096, 4096), ("up_proj", 28672, 4096), ("down_proj", 4096, 14336))
R = dict(x_resident=True)
SWEEP = {  # --sweep: more tiles per shape, (block_n, block_k, split, stages[, x resident][, rows per warp])
    "qkv": (Tile(96, 256, 2, 4, **R), Tile(192, 256, 4, 4, **R), Tile(192, 64, 4, 4)),
    "dense": (Tile(64, 256, 2, 4, **R), Tile(128, 256, 4, 4, **R), Tile(128, 64, 4, 4)),
    "up_proj": (Tile(224, 64, 1, 4),),
    "down_proj": (Tile(256, 256, 8, 3, **R), Tile(128, 64, 4, 4)),
}  # fmt: skip


W16 = dict(rows_per_warp=16)
DIAG = {  # --diag: tiles per shape, each timed with the math and loads-only (skip_mma), with occupancy
    "qkv": (Tile(96, 128, 2, 4, **W16), Tile(96, 64, 2, 4, **W16), Tile(192, 64, 4, 4), Tile(192, 64, 4, 3, **W16)),
    "dense": (Tile(64, 128, 2, 4, **W16), Tile(128, 64, 4, 4, **W16), Tile(128, 128, 4, 2, **W16), Tile(128, 64, 4, 4)),
    "up_proj": (Tile(224, 128, 1, 3), Tile(224, 128, 1, 3, **W16)),
    "down_proj": (Tile(64, 128, 2, 4, **W16), Tile(128, 64, 4, 4, **W16), Tile(128, 128, 4, 2, **W16),
                  Tile(128, 64, 4, 4)),
}  # fmt: skip


def weight_ring(n: int, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of a random bf16 [n, k] weight (scaled by 1 / sqrt(k)) and its [n] bias, together
    at least 4x the L2, so that each call of a graph reads its weight from memory."""
    ring = max(2, -(-4 * L2_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(ring)]
    return ws, [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(ring)]


def run_diag(name, n, k, rows, copy_tb_s) -> list[dict]:
    wbytes = n * k * 2
    ws, _ = weight_ring(n, k)
    ring = len(ws)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = []
    for tile, skip in ((t, sk) for t in DIAG[name] for sk in (False, True)):
        row = {"shape": name, "tile": list(tile.__dict__.values()), "skip_mma": skip}
        row.update(gr.occupancy(n, k, tile, x.device))
        for pdl in (True, False):
            row["pdl_us" if pdl else "us"] = graph_us(
                lambda i, t=tile, p=pdl, sk=skip: gr.gemm_rows(x, ws[i % ring], tile=t, pdl=p, skip_mma=sk),
                calls=CALLS,
            )
        row["tb_s"] = wbytes / (row["pdl_us"] * 1e-6) / 1e12
        print(f"diag {name:10s} {row['tile']} skip_mma={skip:d} blocks/SM {row['blocks_per_sm']} clusters "
              f"{row['clusters']} (max active {row['max_active_clusters']}) | PDL {row['pdl_us']:7.2f} plain "
              f"{row['us']:7.2f} us ({row['tb_s']:.2f} TB/s; copy {copy_tb_s:.2f})", flush=True)  # fmt: skip
        out.append(row)
    return out


ROPE_TILES = (Tile(128, 64, 4, 4, **W16), Tile(128, 128, 4, 2, **W16), Tile(128, 128, 2, 4, **W16),
              Tile(256, 64, 4, 3, **W16))  # fmt: skip
HKV, GROUP, HEAD_D, PAGE = 8, 4, 128, 16


def run_rope(rows: int) -> list[dict]:
    """The decode QKV at `rows` tokens: cuBLAS + fused.rotary_qkv (rotary, K/V cache write)
    against gemm_rows with rope= for each ROPE_TILES tile, µs per call, head-major caches."""
    from sparsegen.kernels.fused import rotary as fused
    from sparsegen.kernels.linear.rope_write import RopeWrite

    n, k = HKV * (GROUP + 2) * HEAD_D, 4096
    ws, bs = weight_ring(n, k)
    ring = len(ws)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    theta = torch.rand(rows, HEAD_D, device="cuda") * 6.28
    cos, sin = theta.cos(), theta.sin()
    pages = 4 * rows
    kc, vc = (
        torch.zeros(pages, HKV, PAGE, HEAD_D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for _ in "kv"
    )
    slots = torch.randperm(pages * PAGE, device="cuda")[:rows]
    rope = RopeWrite(cos, sin, GROUP, kc, vc, slots)

    def plain(i):
        qkv = torch.nn.functional.linear(x, ws[i % ring], bs[i % ring]).view(rows, HKV, GROUP + 2, HEAD_D)
        return fused.rotary_qkv(qkv, cos, sin, (kc, vc), slots)[0]

    base = graph_us(plain, calls=CALLS)
    ref = plain(0).reshape(rows, -1)
    out = []
    for tile in ROPE_TILES:
        q = gr.gemm_rows(x, ws[0], bs[0], tile=tile, rope=rope)
        row = {
            "tile": list(tile.__dict__.values()),
            "cublas_rotary_us": base,
            "err": rel_err(q, ref.double()),
        }
        row["pdl_us"] = graph_us(lambda i, t=tile: gr.gemm_rows(x, ws[i % ring], bs[i % ring], tile=t, rope=rope),
                                 calls=CALLS)  # fmt: skip
        print(f"rope {rows} rows tile {row['tile']}: gemm_rows {row['pdl_us']:7.2f} us against cuBLAS + rotary "
              f"{base:7.2f} us (err {row['err']:.1e})", flush=True)  # fmt: skip
        out.append(row)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def run_shape(name, n, k, rows, tiles, copy_tb_s) -> dict:
    wbytes = n * k * 2
    ws, bs = weight_ring(n, k)
    ring = len(ws)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ ws[0].double().T + bs[0].double()
    out = {"shape": name, "n": n, "k": k, "rows": rows, "floor_us": wbytes / (copy_tb_s * 1e12) * 1e6}
    out["cublas_us"] = graph_us(lambda i: F.linear(x, ws[i % ring], bs[i % ring]), calls=CALLS)
    out["cublas_err"] = rel_err(F.linear(x, ws[0], bs[0]), ref)
    out["tiles"] = []
    for tile in tiles:
        y = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        gr.gemm_rows(x, ws[0], bs[0], tile=tile, out=y)
        x7 = x[:7]  # fewer rows than the tile: the zero-filled rows must not reach the output
        y7 = gr.gemm_rows(x7, ws[0], bs[0], tile=tile)
        row = {"tile": list(tile.__dict__.values()), "err": rel_err(y, ref), "err7": rel_err(y7, ref[:7])}
        for pdl in (True, False):
            row["pdl_us" if pdl else "us"] = graph_us(
                lambda i, pdl=pdl, tile=tile: gr.gemm_rows(x, ws[i % ring], bs[i % ring], tile=tile, pdl=pdl),
                calls=CALLS,
            )
        out["tiles"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32", help="comma-separated row counts")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--diag", action="store_true", help="only the DIAG tiles: occupancy, loads-only timings")
    ap.add_argument(
        "--rope", action="store_true", help="only the decode QKV with rotary + K/V write (ROPE_TILES)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ceil = measure_ceilings()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil.to_dict()}
    results["runs"] = []
    wanted = args.shapes.split(",")
    if args.rope:
        results["rope"] = run_rope(32)
        wanted = []
    if args.diag:
        results["diag"] = [
            r for name, n, k in SHAPES if name in wanted for r in run_diag(name, n, k, 32, ceil.copy_tb_s)
        ]
        wanted = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, n, k in SHAPES:
            if name not in wanted:
                continue
            tiles = (tile_for(n, k), *(SWEEP[name] if args.sweep else ()))
            r = run_shape(name, n, k, rows, tiles, ceil.copy_tb_s)
            results["runs"].append(r)
            for t in r["tiles"]:
                print(summary_line(r, t), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def summary_line(r: dict, t: dict) -> str:
    """One tile of one run_shape result, as the table line the bench prints."""
    head = f"{r['rows']:3d} rows {r['shape']:10s} floor {r['floor_us']:7.2f} us"
    blas = f"cuBLAS {r['cublas_us']:7.2f} (err {r['cublas_err']:.1e})"
    ours = (
        f"tile {t['tile']} PDL {t['pdl_us']:7.2f} plain {t['us']:7.2f} err {t['err']:.1e} / {t['err7']:.1e}"
    )
    return f"{head} | {blas} | {ours}"


if __name__ == "__main__":
    main()
