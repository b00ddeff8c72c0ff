"""Where the time to first token goes: one prompt's prefill in the engine, timed and profiled.

    PYTHONPATH=$PWD python3 benchmarks/profile_prefill.py --lengths 8192,32768 --json out.json
    PYTHONPATH=$PWD python3 benchmarks/profile_prefill.py --smoke     # CPU: tiny model, plumbing only

For each prompt length, on one engine (random 7b weights, bf16, chunks of --chunk tokens, 8K by
default as in the engine):
- TTFT of the first prompt of that length and of a second one (a difference is one-time cost:
  library heuristics, new kernel specialisations), as `bench_generate.py` measures it;
- the GPU kernel time of a third prefill (torch.profiler), grouped as `profile_decode_step.py`
  groups a decode step, plus prefill attention, against the matmul FLOPs of the linear layers
  (2 x parameters x tokens) at the matmul ceiling measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from profile_decode_step import GROUPS as DECODE_GROUPS
from profile_decode_step import grouped, sync
from torch.autograd import DeviceType

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model

GROUPS = (("prefill attention", ("prefill_kernel",)), *DECODE_GROUPS)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft_s(engine: LLMEngine, length: int, seed: int) -> float:
    sync()
    start = time.perf_counter()
    engine.generate([prompt(length, seed)], SamplingParams(max_tokens=1, ignore_eos=True))
    sync()
    return time.perf_counter() - start


def kernel_span_ms(prof) -> tuple[float, float]:
    """(first kernel start to last kernel end, summed kernel time) in ms: their difference is
    the time the GPU sat idle between the prefill's kernels."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]  # fmt: skip
    if not spans:
        return 0.0, 0.0
    return (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3, sum(b - a for a, b in spans) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768", help="comma-separated prompt lengths")
    ap.add_argument(
        "--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill tokens per step)"
    )
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--smoke", action="store_true", help="check the script on a CPU: tiny model")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        size, device, dtype, lengths = "tiny", "cpu", torch.float32, [min(n, 96) for n in lengths]
    elif torch.cuda.is_available():
        size, device, dtype = "7b", "cuda", torch.bfloat16
    else:
        raise SystemExit("profile_prefill needs a CUDA GPU (or --smoke)")
    model = random_model(size, device=device, dtype=dtype, seed=0)
    params = sum(p.numel() for p in model.parameters())
    report: dict = {"size": size, "params": params, "chunk": args.chunk, "runs": []}
    ceiling = None
    if device == "cuda":
        from sparsegen.bench.common import measure_ceilings

        ceiling = measure_ceilings().matmul_tflop_s
        report["matmul_tflops"] = ceiling
    kv = (24 << 30) if device == "cuda" else (64 << 20)
    for n in lengths:
        engine = LLMEngine(model, kv_cache_bytes=kv, max_num_seqs=4, max_num_batched_tokens=args.chunk,
                           use_cuda_graphs=device == "cuda")  # fmt: skip
        engine.generate([prompt(512, 1)], SamplingParams(max_tokens=2, ignore_eos=True))  # as bench_generate
        first, second = ttft_s(engine, n, 2), ttft_s(engine, n, 3)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            ttft_s(engine, n, 4)
        run = {"length": n, "ttft_first_ms": first * 1e3, "ttft_second_ms": second * 1e3}
        print(f"{n} tokens: TTFT first {first * 1e3:.1f} ms, second {second * 1e3:.1f} ms", flush=True)
        if device == "cuda":
            # The GEMMs' FLOPs are 2 x (parameters less the embedding, which is a gather) x tokens.
            gemm_tflop = 2 * (params - model.model.embed_tokens.weight.numel()) * n / 1e12
            kernels = grouped(prof.key_averages(), 1, GROUPS)
            span, busy = kernel_span_ms(prof)
            run.update(kernel_span_ms=span, kernel_busy_ms=busy)
            print(
                f"  kernels span {span:.1f} ms, busy {busy:.1f} ms: the GPU idles {span - busy:.1f} ms between them"
            )
            run.update(gemm_tflop=gemm_tflop, gemm_floor_ms=gemm_tflop / ceiling * 1e3,
                       kernels=[{"group": g, "ms": ms, "launches": c} for g, ms, c in kernels])  # fmt: skip
            print(f"  GEMMs {gemm_tflop:.1f} TFLOP = {gemm_tflop / ceiling * 1e3:.1f} ms at {ceiling:.0f} TFLOP/s; "
                  f"GPU kernels {sum(k[1] for k in kernels):.1f} ms in {sum(k[2] for k in kernels)} launches")  # fmt: skip
            for label, ms, count in kernels:
                print(f"  | {label} | {ms:.2f} ms | {count} |")
            print(
                prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=14, max_name_column_width=60
                )
            )
        report["runs"].append(run)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        del engine


if __name__ == "__main__":
    main()
