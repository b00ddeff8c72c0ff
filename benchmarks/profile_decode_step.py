"""Where a batch-1 decode step of Phi-3-Small `7b` (random weights, bf16) spends its time (GPU).

    PYTHONPATH=$PWD python3 benchmarks/profile_decode_step.py [--context 8192] [--steps 8]

Prints, for one sequence with a `--context`-token prompt: the wall time of an engine step with
CUDA graphs and without, the summed GPU kernel time of an eager step (torch.profiler), and the
kernels that take the most of it. The gap between wall and kernel time is host work (Python,
launches, sampling, the token read-back); the weight read at the copy rate is the floor.
"""

from __future__ import annotations

import argparse
import time

import torch

from sparsegen.bench.common import measure_ceilings
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model


def engine_at(model, context: int, steps: int, graphs: bool) -> LLMEngine:
    engine = LLMEngine(model, kv_cache_bytes=8 << 30, max_num_seqs=1, max_num_batched_tokens=8192,
                       use_cuda_graphs=graphs)  # fmt: skip
    prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.submit([prompt], SamplingParams(max_tokens=4 * steps + 8, ignore_eos=True))
    for _ in range(6):  # prefill, then warm-up steps (compiles, graph capture)
        engine.step()
    torch.cuda.synchronize()
    return engine


def step_ms(engine: LLMEngine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    model = random_model("7b", device="cuda", dtype=torch.bfloat16, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = measure_ceilings().copy_tb_s * 1e12  # bytes read + written per second
    print(
        f"weights {weight_bytes / 1e9:.2f} GB: {weight_bytes / bw * 1e3:.2f} ms at the copy rate {bw / 1e12:.2f} TB/s"
    )
    graphed = engine_at(model, args.context, args.steps, graphs=True)
    print(f"step with CUDA graphs: {step_ms(graphed, args.steps):.2f} ms")
    del graphed
    eager = engine_at(model, args.context, args.steps, graphs=False)
    print(f"step without graphs:   {step_ms(eager, args.steps):.2f} ms")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            eager.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    print(f"GPU kernel time per eager step: {gpu_us / 1e3:.2f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))


if __name__ == "__main__":
    main()
