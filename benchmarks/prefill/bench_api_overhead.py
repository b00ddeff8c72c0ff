"""What `sparsegen.prefill` costs over the compiled kernel, on the GPU: GPU time per call of each
way in, in alternating rounds, and the host's own time per call (calls queued without a sync).

    PYTHONPATH=$PWD python3 benchmarks/prefill/bench_api_overhead.py --seq-len 8192 --json out.json

Ways in, for phi3small's sparse layer (bf16, batch 1): `launch` = a prepared `Launch` called
again (the kernel alone); `kernel` = `get_kernel(...)(q, k, v, cu, cu, check=False)` (its shape
checks, prepare, launch); `api_max` = `sparsegen.prefill(..., max_seqlen_q/k=S)` (no device
sync); `api` = `sparsegen.prefill` with its host check of cu_seqlens (one sync). When a way's
host time per call exceeds the kernel's GPU time, its GPU time is the host's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sparsegen
from sparsegen.commands.bench.common import median_ms
from sparsegen.commands.bench.prefill import inputs
from sparsegen.kernels.prefill import get_prefill_kernel


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call, the calls queued back to back (one sync before, none inside)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    per_call = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_api_overhead needs a CUDA GPU")
    s = args.seq_len
    layer = sparsegen.get_pattern("phi3small").layers[0]
    q, k, v, cu = inputs(layer, s)
    kernel = get_prefill_kernel(layer, dtype=torch.bfloat16)
    scale = layer.head_dim**-0.5
    launch = kernel.prepare(q, k, v, cu, cu, scale, max_seqlen_k=s)
    ways = {
        "launch": launch,
        "kernel": lambda: kernel(q, k, v, cu, cu, check=False),
        "api_max": lambda: sparsegen.prefill(q, k, v, cu, cu, layer, max_seqlen_q=s, max_seqlen_k=s),
        "api": lambda: sparsegen.prefill(q, k, v, cu, cu, layer),
    }
    gpu = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in list(ways)[:: 1 if r % 2 == 0 else -1]:
            gpu[name].append(median_ms(ways[name]))
    host = {name: host_us(fn) for name, fn in ways.items() if name != "api"}  # api syncs each call
    report = {"variant": kernel.request.variant, "seq_len": s, "rounds": args.rounds}
    base = sorted(gpu["launch"])[len(gpu["launch"]) // 2]
    for name in ways:
        ms = sorted(gpu[name])[len(gpu[name]) // 2]
        report[name] = {"ms": ms, "over_launch": ms / base, "host_us": host.get(name)}
        extra = f"  host {host[name]:7.1f} us/call" if name in host else ""
        print(f"{name:8s} {ms:.4f} ms  x{ms / base:.3f} of launch{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
