"""Where a batch-1 decode step of Phi-3-Small `7b` (random weights, bf16) spends its time (GPU).

    PYTHONPATH=$PWD python3 benchmarks/profile_decode_step.py [--context 8192] [--steps 8] [--compile]

Prints, for one sequence with a `--context`-token prompt:
- the wall time of an engine step with CUDA graphs (and, with `--compile`, with torch.compile
  inside the graphs) and without graphs;
- the GPU kernel time of an eager step (torch.profiler), grouped (linear layers, LayerNorm,
  paged decode, fused elementwise, other), and the kernels that take the most of it;
- the paged-decode split-KV sweep of one sparse and one dense layer at this context: the time of
  one launch per split count, next to the count the heuristic picks (graph-width and eager).
The gap between wall and kernel time is host work (Python, launches, sampling, the token
read-back); the weight read at the copy rate is the floor.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType

from sparsegen.bench.common import measure_ceilings
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.engine.cuda_graphs import width_bucket
from sparsegen.models import random_model

GROUPS = (  # (label, substrings of kernel names), first match wins
    ("linear layers (GEMV/GEMM)", ("nvjet", "gemm", "gemv", "cublas", "splitkreduce", "cutlass")),
    ("paged decode", ("sparsegen_paged_decode", "paged_decode", "decode_reduce")),
    ("LayerNorm (+ residual add)", ("layer_norm", "add_layer_norm")),
    ("fused rotary/KV write, GeGeLU", ("rotary_qkv", "gegelu")),
    ("inductor kernels", ("triton_", "fused_")),
)


def engine_at(model, context: int, steps: int, graphs: bool, compiled: bool = False) -> LLMEngine:
    engine = LLMEngine(model, kv_cache_bytes=8 << 30, max_num_seqs=1, max_num_batched_tokens=8192,
                       use_cuda_graphs=graphs, compile_model=compiled)  # fmt: skip
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


def grouped(events, steps: int) -> list[tuple[str, float, int]]:
    """(group, ms per step, kernels per step) from profiler key averages of device kernels."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA or e.self_device_time_total <= 0:
            continue  # CPU-side ops (aten::addmm...) also carry their kernels' time: count kernels once
        name = e.key.lower()
        label = next((g for g, keys in GROUPS if any(k in name for k in keys)), "other (copies, adds, ...)")
        t = totals.setdefault(label, [0.0, 0])
        t[0] += e.self_device_time_total / 1e3 / steps
        t[1] += e.count / steps
    return sorted(((k, v[0], round(v[1])) for k, v in totals.items()), key=lambda r: -r[1])


def split_sweep(engine: LLMEngine, context: int) -> None:
    from sparsegen.kernels.decode import _sm_count, get_decode_kernel, num_splits

    model, cache = engine.model, engine.cache
    seq = engine.scheduler.running[0]
    ps = cache.page_size
    dev = model.device
    table = torch.tensor([seq.pages], dtype=torch.int32, device=dev)  # [1, pages]
    width = width_bucket(len(seq.pages), -(-engine.max_model_len // ps))
    wide = torch.full((1, width), cache.scratch_page, dtype=torch.int32, device=dev)
    wide[0, : len(seq.pages)] = table[0]
    lens = torch.tensor([len(seq)], dtype=torch.int32, device=dev)
    sms = _sm_count(dev)
    for kind, idx in (("sparse", 0), ("dense", 1)):
        layer = model.spec.layers[idx]
        kern = get_decode_kernel(layer, dtype=model.dtype, page_size=ps)
        q = torch.randn(1, layer.num_heads, layer.head_dim, device=dev, dtype=model.dtype)
        groups = layer.num_heads // kern.heads_per_block
        pick_graph = num_splits(groups, width * ps, sms)
        pick_eager = num_splits(groups, len(seq.pages) * ps, sms)
        row = []
        for s in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
            for _ in range(3):
                kern.launch(q, cache.k[idx], cache.v[idx], wide, lens, 1 / 128, splits=s)
            torch.cuda.synchronize()
            n = 50
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                kern.launch(q, cache.k[idx], cache.v[idx], wide, lens, 1 / 128, splits=s)
            stop.record()
            torch.cuda.synchronize()
            row.append(f"{s}:{start.elapsed_time(stop) * 1e3 / n:.1f}")
        print(f"decode {kind} layer at {len(seq)} tokens, us per launch by splits (eager launches, incl. reduce): "
              f"{' '.join(row)}; heuristic picks {pick_graph} (graph width {width} pages), {pick_eager} (eager)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile inside the graphs")
    args = ap.parse_args()
    model = random_model("7b", device="cuda", dtype=torch.bfloat16, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = measure_ceilings().copy_tb_s * 1e12  # bytes read + written per second
    floor_ms = weight_bytes / bw * 1e3
    print(f"weights {weight_bytes / 1e9:.2f} GB: {floor_ms:.2f} ms at the copy rate {bw / 1e12:.2f} TB/s")
    graphed = engine_at(model, args.context, args.steps, graphs=True)
    ms = step_ms(graphed, args.steps)
    print(
        f"step with CUDA graphs: {ms:.2f} ms ({1e3 / ms:.1f} tok/s, {floor_ms / ms:.0%} of the weight-read floor)"
    )
    del graphed
    if args.compile:
        comp = engine_at(model, args.context, args.steps, graphs=True, compiled=True)
        ms = step_ms(comp, args.steps)
        print(f"step with torch.compile in CUDA graphs: {ms:.2f} ms ({1e3 / ms:.1f} tok/s)")
        del comp
    eager = engine_at(model, args.context, args.steps, graphs=False)
    print(f"step without graphs:   {step_ms(eager, args.steps):.2f} ms")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, acc_events=True) as prof:
        for _ in range(args.steps):
            eager.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = grouped(events, args.steps)
    print(f"GPU kernel time per eager step: {sum(r[1] for r in kernels):.2f} ms")
    print("| what | GPU ms per step | kernels per step |\n|---|---|---|")
    for label, ms, count in kernels:
        print(f"| {label} | {ms:.3f} | {count} |")
    print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
    split_sweep(eager, args.context)


if __name__ == "__main__":
    main()
