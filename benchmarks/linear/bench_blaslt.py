"""Decode-step linears: torch's cuBLAS call against every cuBLASLt heuristic candidate (GPU).

    PYTHONPATH=$PWD python benchmarks/linear/bench_blaslt.py --out blaslt.json

Per Phi-3-Small 7b linear (qkv, dense, up_proj, down_proj with bias; lm_head without), weights
stored as the model stores them (down_proj and lm_head [in, out], the rest [out, in]), at 1 and
32 rows and at 8192 (a prefill chunk, block linears only), bf16. Time = one call inside a CUDA
graph of 24 calls, each on another weight copy (4 for lm_head and at 8192 rows), median of
`--rounds` interleaved rounds, for `F.linear` / `torch.addmm` (what the model calls) and for each
algorithm `blaslt.LtLinear` (this folder) gets from cuBLASLt's heuristic. Every candidate's
output is checked against torch's (relative error). Floor = weight bytes at this process's copy
rate (decode rows), the matmul at 700 TFLOP/s (8192 rows).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from bench_linear_layout import floor_us, save_rows
from blaslt import LtLinear

from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.testing import rel_err

CALLS = 24
SHAPES = (("qkv", 6144, 4096, False), ("dense", 4096, 4096, False), ("up_proj", 28672, 4096, False),
          ("down_proj", 4096, 14336, True), ("lm_head", 100352, 4096, True))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="blaslt.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,32,8192")
    ap.add_argument("--max-algos", type=int, default=16)
    args = ap.parse_args()
    bw = measure_ceilings().copy_tb_s * 1e12
    out_rows = []
    for name, n, k, in_major in SHAPES:
        for m in (int(r) for r in args.rows.split(",")):
            if m > 32 and name == "lm_head":
                continue
            calls = CALLS if (m <= 32 and name != "lm_head") else 4
            w = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(calls)
            ]  # [N, K]
            if in_major:
                w = [t.t().contiguous() for t in w]  # [K, N]
            bias = None if name == "lm_head" else torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # [M, K]
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)  # [M, N]

            def plain(i, x=x, w=w, bias=bias, in_major=in_major):
                t = w[i % len(w)]
                if not in_major:
                    return F.linear(x, t, bias)
                return torch.mm(x, t) if bias is None else torch.addmm(bias, x, t)

            lt = LtLinear(
                m, n, k, dtype=torch.bfloat16, bias=bias is not None, in_major=in_major, device="cuda"
            )
            cands = list(range(min(len(lt.algos), args.max_algos)))
            ref = plain(0).float()
            errs = {}
            for a in cands:
                errs[a] = rel_err(lt(x, w[0], bias, out, algo=a).float(), ref)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                times.setdefault("torch", []).append(graph_us(plain, calls=calls))
                for a in cands:
                    if errs[a] > 2e-2:
                        continue

                    def run(i, a=a, x=x, w=w, bias=bias, out=out, lt=lt):
                        return lt(x, w[i % len(w)], bias, out, algo=a)

                    times.setdefault(f"lt{a}", []).append(graph_us(run, calls=calls))
            us = {key: statistics.median(ts) for key, ts in times.items()}
            lt_us = {key: u for key, u in us.items() if key != "torch"}
            best = min(lt_us, key=lt_us.get)
            floor = floor_us(m, n, k, bw)
            out_rows.append({"name": name, "rows": m, "in_major": in_major, "floor_us": floor, "us": us,
                             "rel_err": {f"lt{a}": e for a, e in errs.items()}, "algos": len(lt.algos)})  # fmt: skip
            print(
                f"{name:>9} M={m:<4} floor {floor:8.2f} | torch {us['torch']:8.2f} | lt0 {us.get('lt0', float('nan')):8.2f}"
                f" | best {best} {lt_us[best]:8.2f} ({us['torch'] / lt_us[best]:.3f}x torch) | {len(lt.algos)} algos,"
                f" {len(cands)} timed, {sum(e > 2e-2 for e in errs.values())} off",
                flush=True,
            )
            del w, lt
            torch.cuda.empty_cache()
    save_rows(args.out, bw, out_rows)


if __name__ == "__main__":
    main()
