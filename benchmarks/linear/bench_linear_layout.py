"""Decode-step linears of Phi-3-Small 7b through torch's BLAS paths (GPU), in one process.

    PYTHONPATH=$PWD python benchmarks/linear/bench_linear_layout.py --out linear_layout.json

Per block linear (qkv, dense, up_proj, down_proj, all with bias) and lm_head, at 1 and 32 rows
(decode) and 8192 (a prefill chunk; block linears only), bf16: `F.linear(x, W, b)` with W [N, K] (the model's call today) against `torch.addmm(b, x, Wt)`
with Wt [K, N] stored transposed, each under torch's cuBLAS and cuBLASLt back ends
(torch.backends.cuda.preferred_blas_library). Time = one call inside a CUDA graph of 24 calls,
each on another copy of the weight (far above the L2, as in a decode step), median of 3
interleaved rounds; floor = weight bytes / the copy rate of this process. Outputs are checked
against the first variant's. At 8192 rows "floor" is the matmul at 700 TFLOP/s instead.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.testing import rel_err

CALLS = 24
SHAPES = (("qkv", 6144, 4096), ("dense", 4096, 4096), ("up_proj", 28672, 4096),
          ("down_proj", 4096, 14336), ("lm_head", 100352, 4096))  # fmt: skip
ROWS = (1, 32, 8192)
PREFILL_FLOPS = 700e12  # a round matmul rate for the 8192-row floor column
BACKENDS = ("cublas", "cublaslt")


def floor_us(m: int, n: int, k: int, bw: float) -> float:
    """The weight read at the copy rate `bw` (B/s) for decode rows, the matmul at PREFILL_FLOPS above."""
    return n * k * 2 / bw * 1e6 if m <= 32 else 2 * m * n * k / PREFILL_FLOPS * 1e6


def save_rows(path: str, bw: float, rows: list) -> None:
    with open(path, "w") as f:
        json.dump({"copy_rate_Bps": bw, "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="linear_layout.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bw = measure_ceilings().copy_tb_s * 1e12  # timed outside a graph (see bench_decode_layout)
    rows = []
    for name, n, k in SHAPES:
        copies = 4 if name == "lm_head" else CALLS
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]  # [N, K]
        wt = [x.t().contiguous() for x in w]  # [K, N]
        bias = None if name == "lm_head" else torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            if m > 32 and name == "lm_head":  # a prefill takes the logits of its last rows only
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]

            def lin(i, x=x, w=w, bias=bias):
                return F.linear(x, w[i % len(w)], bias)

            def mm(i, x=x, wt=wt, bias=bias):
                t = wt[i % len(wt)]
                return torch.mm(x, t) if bias is None else torch.addmm(bias, x, t)

            ref = lin(0).float()
            times: dict[str, list[float]] = {}
            errs = {}
            for _ in range(args.rounds):
                for backend in BACKENDS:
                    torch.backends.cuda.preferred_blas_library(backend)
                    for vname, fn in (("linear_W", lin), ("addmm_Wt", mm)):
                        key = f"{backend}_{vname}"
                        times.setdefault(key, []).append(graph_us(fn, calls=CALLS))
                        errs[key] = rel_err(fn(0).float(), ref)
            torch.backends.cuda.preferred_blas_library("cublas")
            floor = floor_us(m, n, k, bw)
            us = {key: statistics.median(ts) for key, ts in times.items()}
            rows.append({"name": name, "rows": m, "floor_us": floor, "us": us, "rel_err": errs})
            cells = " ".join(f"{key} {u:7.2f}" for key, u in us.items())
            print(f"{name:>9} M={m:<3} floor {floor:7.2f} us | {cells}", flush=True)
        del w, wt
        torch.cuda.empty_cache()
    save_rows(args.out, bw, rows)


if __name__ == "__main__":
    main()
