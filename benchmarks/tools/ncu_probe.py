"""A few launches of the batch-32 decode step's kernels, for Nsight Compute's counters (GPU).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 benchmarks/tools/ncu_probe.py [--what decode,down]

Only the launches between cudaProfilerStart and cudaProfilerStop are profiled (hence
`--profile-from-start off`), each once, after a warm-up launch outside that window:
  decode  Phi-3-Small's sparse (layer 0) and dense (layer 1) paged decode at 32 x 8K, bf16,
          head-major pages of 16 tokens, shuffled page tables (the engine's layout and split rule);
  down    the down_proj linear at 32 rows: cuBLAS (`F.linear`) and gemm_rows's tuned tile;
  dense   the output projection at 32 rows, the same two.
This script times nothing; the counters are what it is for.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import sparsegen
from sparsegen.kernels import decode as dec
from sparsegen.kernels.linear import gemm_rows as gr


def decode_launches():
    spec = sparsegen.get_pattern("phi3small")
    batch, ctx, page_size = 32, 8192, 16
    out = []
    for layer in (spec.layers[0], spec.layers[1]):
        kern = dec.get_decode_kernel(layer, dtype=torch.bfloat16, page_size=page_size)
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pages = batch * ctx // page_size
        # caches: [pages, page_size, Hkv, D] views of head-major [pages, Hkv, page_size, D] buffers
        k, v = (torch.randn(pages, hkv, page_size, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))  # fmt: skip
        tables = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)  # [B, pages/seq]
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)  # [B, H, D]
        out.append(lambda kern=kern, q=q, k=k, v=v, t=tables, n=lens, d=d: kern.launch(q, k, v, t, n, 1 / d))
    return out


def linear_launches(n: int, k: int):
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)  # [rows, K]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5  # [N, K]
    return [lambda: F.linear(x, w), lambda: gr.gemm_rows(x, w, pdl=False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="decode,down,dense")
    args = ap.parse_args()
    launches = []
    for what in args.what.split(","):
        if what == "decode":
            launches += decode_launches()
        elif what == "down":
            launches += linear_launches(4096, 14336)
        elif what == "dense":
            launches += linear_launches(4096, 4096)
        else:
            raise SystemExit(f"--what: decode, down, dense; got {what!r}")
    for fn in launches:  # builds, allocations and lazy initialisation outside the window
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in launches:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
