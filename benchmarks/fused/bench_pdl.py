"""Programmatic dependent launch for the fused add + LayerNorm kernel (`kernels.fused.add_norm.use_pdl`). (GPU)

    PYTHONPATH=$PWD python3 benchmarks/fused/bench_pdl.py [--batch 1,32] [--context 8192] [--json OUT]

Kernel pairs of a 7b decode step as they follow each other (bf16, CUDA-graph replays
over a ring of weight copies several times L2, so every GEMV starts cold): a cuBLAS linear layer
(F.linear) and the fused kernel after it, launched plainly and with PDL (the fused kernel is
launched while the GEMV still runs and waits for it on the device); us per pair. Rotary and
GeGeLU took PDL in session 6's call 3 (no gain / slower) and now always launch plainly, so their
two "pdl" columns time the same launch: they show the noise.
The engine's decode step with and without it: `benchmarks/engine/ab_decode_step.py`.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from sparsegen.commands.bench.common import graph_us

HIDDEN, FF, HKV, G, D = 4096, 14336, 8, 4, 128
RING_BYTES = 400 << 20


SPECS = {  # pair: (out features, in features) of the linear layer before the fused kernel
    "o+norm": (HIDDEN, HIDDEN),
    "up+gegelu": (2 * FF, HIDDEN),
    "qkv+rotary": ((HKV * (G + 2)) * D, HIDDEN),
}


def pair_row(name: str, batch: int) -> dict:
    from sparsegen.kernels.fused import add_norm, gegelu, rotary

    dev, dt = "cuda", torch.bfloat16
    n, k = SPECS[name]
    ring = max(4, math.ceil(RING_BYTES / (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(ring)]  # [n, k]
    x = torch.randn(batch, k, device=dev, dtype=dt)  # [B, k]
    res = torch.randn(batch, HIDDEN, device=dev, dtype=dt)  # [B, hidden]
    lnw, lnb = torch.ones(HIDDEN, device=dev, dtype=dt), torch.zeros(HIDDEN, device=dev, dtype=dt)
    cos, sin = torch.rand(batch, D, device=dev), torch.rand(batch, D, device=dev)  # [B, D] float32
    out0 = F.linear(x, ws[0])  # [B, n]

    def run(pdl: bool | None, gemm: bool = True, after: bool = True):
        def fn(i):
            y = F.linear(x, ws[i % ring]) if gemm else out0
            if not after:
                return
            if name == "o+norm":
                add_norm.add_layer_norm(y, res, lnw, lnb, 1e-5, pdl=pdl)
            elif name == "up+gegelu":
                gegelu.gegelu(y, 10.0)  # plain launch: PDL measured no gain here (call 3)
            else:
                rotary.rotary_qkv(y.view(batch, HKV, G + 2, D), cos, sin)  # plain: PDL was slower

        return fn

    calls = 2 * ring
    r = {"pair": name, "batch": batch}
    r["gemm"] = graph_us(run(None, after=False), calls=calls)
    r["fused"] = graph_us(run(False, gemm=False), calls=calls)
    r["plain"] = graph_us(run(False), calls=calls)
    r["pdl"] = graph_us(run(True), calls=calls)
    r["plain_again"] = graph_us(run(False), calls=calls)
    r["pdl_again"] = graph_us(run(True), calls=calls)
    print(f"b{batch} {name:11s} gemm {r['gemm']:.2f}  fused alone {r['fused']:.2f}  pair plain "
          f"{r['plain']:.2f} / {r['plain_again']:.2f}  pdl {r['pdl']:.2f} / {r['pdl_again']:.2f} us",
          flush=True)  # fmt: skip
    return r


def pairs(batch: int) -> list[dict]:
    rows = []
    for name in SPECS:
        rows.append(pair_row(name, batch))
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl needs a CUDA GPU")
    batches = [int(b) for b in args.batch.split(",")]
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["pairs"] = [r for b in batches for r in pairs(b)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
