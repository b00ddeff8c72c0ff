"""The skinny GEMM (`models.skinny_gemm`) against cuBLAS on the 7b model's decode shapes (GPU).

    PYTHONPATH=$PWD python3 benchmarks/bench_skinny.py [--rows 32,1] [--json OUT]

For each row count and linear layer of the 7b model (bf16, with bias; lm_head without): us per
call of F.linear (cuBLAS) and of every SkinnyConfig in the sweep, CUDA-graph replays over a ring
of weight copies several times L2 (every call starts cold), the best config, its speed-up and
its read rate (weight bytes / time); the best config's output against F.linear's (max relative
error, bf16).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from sparsegen.bench.common import graph_us

LAYERS = {  # name: (out, in, bias)
    "qkv": (6144, 4096, True),
    "o": (4096, 4096, True),
    "up": (28672, 4096, True),
    "down": (4096, 14336, True),
    "lm_head": (100352, 4096, False),
}
RING_BYTES = 400 << 20
SWEEP = [
    (bn, bk, st, nw)
    for bn, bk, st, nw in itertools.product((16, 32, 64), (128, 256), (3, 4, 6), (4, 8))
    if not (nw == 8 and bn < 32)
]


def row(name: str, m: int) -> dict:
    from sparsegen.models.skinny_gemm import SkinnyConfig, skinny_linear

    n, k, has_bias = LAYERS[name]
    dev, dt = "cuda", torch.bfloat16
    ring = max(2, math.ceil(RING_BYTES / (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(ring)]  # [n, k]
    bs = [torch.randn(n, device=dev, dtype=dt) if has_bias else None for _ in range(ring)]
    x = torch.randn(m, k, device=dev, dtype=dt)  # [m, k]
    calls = 2 * ring
    r = {"layer": name, "rows": m, "mb": n * k * 2 / 2**20}
    r["cublas_us"] = graph_us(lambda i: F.linear(x, ws[i % ring], bs[i % ring]), calls=calls)
    best = None
    for bn, bk, st, nw in SWEEP:
        cfg = SkinnyConfig(block_n=bn, block_k=bk, num_stages=st, num_warps=nw)
        try:
            us = graph_us(lambda i, cfg=cfg: skinny_linear(x, ws[i % ring], bs[i % ring], cfg), calls=calls)
        except Exception as exc:  # out of shared memory for this tile: skip the config
            r.setdefault("skipped", []).append(f"{cfg}: {type(exc).__name__}")
            continue
        r.setdefault("sweep", []).append({"config": [bn, bk, st, nw], "us": us})
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is not None:
        us, cfg = best
        got = skinny_linear(x, ws[0], bs[0], cfg).float()
        want = F.linear(x, ws[0], bs[0]).float()
        r.update(best_us=us, best=[cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps],
                 speedup=r["cublas_us"] / us, tb_s=n * k * 2 / us / 1e6,
                 rel_err=((got - want).abs().max() / want.abs().max()).item())  # fmt: skip
        print(f"M={m:2d} {name:8s} {r['mb']:6.1f} MB  cuBLAS {r['cublas_us']:7.2f} us  skinny {us:7.2f} us "
              f"{r['best']}  x{r['speedup']:.3f}  {r['tb_s']:.2f} TB/s  rel err {r['rel_err']:.2e}",
              flush=True)  # fmt: skip
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,1")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_skinny needs a CUDA GPU")
    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for name in args.layers.split(","):
            rows.append(row(name, m))
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
