"""Batch-1 linear layers of Phi-3-Small 7b: cuBLAS (`F.linear`) against sparsegen's Triton GEMV (GPU).

    PYTHONPATH=$PWD python3 benchmarks/linear/bench_gemv.py [--out gemv.json] [--sweep]

For each 7b shape (qkv, dense, up_proj + GeGeLU, down_proj, lm_head), bf16, one row: the time
of one call inside a CUDA graph of 24 calls, each call on another copy of the weight (0.8 to
1.6 GB of copies, far above the 50 MB L2, as in a decode step where 32 layers' weights stream
through), and the read rate. `up_proj + GeGeLU` compares F.linear
followed by the fused GeGeLU kernel (today's path) with the GEMV that does both; the `norm+`
rows put the fused residual add + LayerNorm kernel before cuBLAS, against the GEMV that does
the norm itself (what the model's triton_gemv path runs). Each GEMV
result is checked against F.linear (rel err). `--sweep` also times every (BLOCK_N, BLOCK_K,
warps) tile and prints the best, next to the heuristic's.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from sparsegen.commands.bench.common import graph_us as _graph_us

CALLS = 24
SHAPES = (  # name, N (weight rows), K, with bias, GeGeLU, residual add + LayerNorm before it, rotary
    ("qkv", 6144, 4096, True, False, False, False),
    ("dense", 4096, 4096, True, False, False, False),
    ("up_proj+gegelu", 28672, 4096, True, True, False, False),
    ("down_proj", 4096, 14336, True, False, False, False),
    ("lm_head", 100352, 4096, False, False, False, False),
    ("norm+qkv", 6144, 4096, True, False, True, False),
    ("norm+qkv+rope", 6144, 4096, True, False, True, True),
    ("norm+up_proj+gegelu", 28672, 4096, True, True, True, False),
    ("norm+lm_head", 100352, 4096, False, False, True, False),
)
HKV, GROUP, HEAD_D = 8, 4, 128  # the 7b attention: qkv rows = HKV * (GROUP + 2) * HEAD_D
LAYER = ("qkv", "dense", "up_proj+gegelu", "down_proj")  # the four linears of a block
LAYER_FUSED = ("norm+qkv", "dense", "norm+up_proj+gegelu", "down_proj")  # the model's triton_gemv path
LIMIT = 20.0


def graph_us(fn) -> float:
    """Microseconds per call of fn(i), i in range(CALLS), from CUDA-graph replays."""
    return _graph_us(fn, calls=CALLS)


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time every tile configuration")
    ap.add_argument(
        "--pdl", action="store_true", help="launch the GEMVs with PDL (consecutive calls overlap)"
    )
    ap.add_argument("--wide", action="store_true", help="with --sweep: also block_n 2, 2048 / 16384 "
                    "W elements per iteration and 2 warps")  # fmt: skip
    ap.add_argument("--shapes", default=None, help="comma-separated names from SHAPES (default: all)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    from sparsegen.kernels.fused import add_norm, gegelu, rotary
    from sparsegen.kernels.linear import gemv

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for name, n, k, has_bias, geg, norm, rope in SHAPES:
        if wanted is not None and name not in wanted:
            continue
        copies = max(2, min(CALLS, -(-(3 << 29) // (n * k * 2))))  # >= 1.5 GB of weights in all
        ws = [(torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dt) for _ in range(copies)]
        b = torch.randn(n, device=dev, generator=gen).to(dt) if has_bias else None
        x = torch.randn(1, k, device=dev, generator=gen).to(dt)
        res = torch.randn(1, k, device=dev, generator=gen).to(dt)
        lnw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(dt)
        lnb = (0.1 * torch.randn(k, device=dev, generator=gen)).to(dt)
        nbytes = n * k * 2
        # rotary: a decode token's cos/sin and a head-major page cache (as the engine's)
        theta = torch.rand(1, HEAD_D // 2, device=dev, generator=gen).repeat(1, 2) * 6
        cos, sin = theta.cos(), theta.sin()  # [1, D] float32
        kc, vc = (torch.zeros(64, HKV, 16, HEAD_D, device=dev, dtype=dt).permute(0, 2, 1, 3) for _ in "kv")
        slot = torch.tensor([37], device=dev)

        rot = (cos, sin, kc, vc, slot)

        def plain(i, ws=ws, b=b, x=x, geg=geg, norm=norm, res=res, lnw=lnw, lnb=lnb, rope=rope, rot=rot):
            if norm:  # today's path: the fused add + LayerNorm kernel, then cuBLAS
                x, _ = add_norm.add_layer_norm(x, res, lnw, lnb, 1e-5)
            y = torch.nn.functional.linear(x, ws[i % len(ws)], b)
            if rope:  # then the rotary kernel with the cache write
                cs, sn, kcache, vcache, sl = rot
                return rotary.rotary_qkv(y.view(1, HKV, GROUP + 2, HEAD_D), cs, sn, (kcache, vcache), sl)[0]
            return gegelu.gegelu(y, LIMIT) if geg else y

        def ours(i, ws=ws, b=b, x=x, geg=geg, norm=norm, res=res, lnw=lnw, lnb=lnb, rope=rope, rot=rot,
                 pdl=args.pdl, **tile):  # fmt: skip
            cs, sn, kcache, vcache, sl = rot
            rw = gemv.RopeWrite(cs, sn, GROUP, kcache, vcache, sl) if rope else None
            out = gemv.gemv(x, ws[i % len(ws)], b, gegelu_limit=LIMIT if geg else None,
                            norm=(res, lnw, lnb, 1e-5) if norm else None, rope=rw, pdl=pdl, **tile)  # fmt: skip
            out = out[0] if norm else out
            return out.view(1, HKV * GROUP, HEAD_D) if rope else out

        err = rel_err(ours(0), plain(0))
        t_plain, t_ours = graph_us(plain), graph_us(ours)
        row = {"name": name, "n": n, "k": k, "cublas_us": t_plain, "gemv_us": t_ours, "rel_err": err,
               "cublas_tb_s": nbytes / t_plain / 1e6, "gemv_tb_s": nbytes / t_ours / 1e6}  # fmt: skip
        if args.sweep:
            best = None
            tried = 0
            row["sweep"] = []
            wide = args.wide
            for bn in (2, 4, 8, 16) if wide else (4, 8, 16):
                for elems in (2048, 4096, 8192, 16384) if wide else (4096, 8192):  # W elements per iteration
                    bk = elems // (bn * (2 if geg or rope else 1))
                    if not 128 <= bk <= min(4096, triton.next_power_of_2(k)):
                        continue
                    for warps in (2, 4, 8) if wide else (4, 8):
                        for prefetch, row_sum in ((False, False), (True, False), (False, True), (True, True)):
                            tile = {"block_n": bn, "block_k": bk, "num_warps": warps,
                                    "prefetch": prefetch, "row_sum": row_sum}  # fmt: skip
                            try:
                                t = graph_us(lambda i, tile=tile: ours(i, **tile))
                            except Exception as exc:  # noqa: BLE001 - a tile that fails to build is skipped
                                print(f"  {name} {tile}: {type(exc).__name__}")
                                continue
                            tried += 1
                            row["sweep"].append({**tile, "us": t})
                            if best is None or t < best[0]:
                                best = (t, tile)
            if best is not None:
                row.update(
                    best_us=best[0], best_tile=best[1], best_tb_s=nbytes / best[0] / 1e6, tiles_tried=tried
                )
        rows.append(row)
        line = (f"{name:15s} N {n:6d} K {k:5d}: cuBLAS {t_plain:7.2f} us ({row['cublas_tb_s']:.2f} TB/s)  "
                f"GEMV {t_ours:7.2f} us ({row['gemv_tb_s']:.2f} TB/s)  x{t_plain / t_ours:.2f}  rel err {err:.1e}")  # fmt: skip
        if "best_us" in row:
            line += f"  best tile {row['best_tile']} {row['best_us']:.2f} us ({row['best_tb_s']:.2f} TB/s)"
        print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
    r = {row["name"]: row for row in rows}
    if wanted is not None and not set(LAYER) | set(LAYER_FUSED) | {"lm_head", "norm+lm_head"} <= set(r):
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"calls_per_graph": CALLS, "rows": rows}, f, indent=2)
        return
    plain_ms = (32 * sum(r[s]["cublas_us"] for s in LAYER_FUSED) + r["norm+lm_head"]["cublas_us"]) / 1e3
    bare_ms = (32 * sum(r[s]["gemv_us"] for s in LAYER) + r["lm_head"]["gemv_us"]) / 1e3
    fused_ms = (32 * sum(r[s]["gemv_us"] for s in LAYER_FUSED) + r["norm+lm_head"]["gemv_us"]) / 1e3
    print(f"one layer's four linears: cuBLAS {sum(r[s]['cublas_us'] for s in LAYER):.1f} us, GEMV "
          f"{sum(r[s]['gemv_us'] for s in LAYER):.1f} us. Per step (32 layers + lm_head, the norms included): "
          f"today's kernels {plain_ms:.3f} ms, GEMV + separate norms "
          f"{bare_ms + (r['norm+qkv']['cublas_us'] - r['qkv']['cublas_us']) * 65 / 1e3:.3f} ms, "
          f"GEMV with the norms inside {fused_ms:.3f} ms")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls_per_graph": CALLS, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
