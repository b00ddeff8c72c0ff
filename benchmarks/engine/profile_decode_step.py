"""Where a decode step of Phi-3-Small `7b` (random weights, bf16) spends its time (GPU).

    PYTHONPATH=$PWD python3 benchmarks/engine/profile_decode_step.py [--batch 1] [--context 8192] [--steps 8]
                                                              [--compile] [--json OUT]
    PYTHONPATH=$PWD python3 benchmarks/engine/profile_decode_step.py --smoke   # CPU, tiny model: the plumbing

Prints, for `--batch` sequences with a `--context`-token prompt each:
- the wall time of an engine step with CUDA graphs, as the engine runs by default (async_decode:
  step n+1 is launched before step n's tokens are read, so the host's work hides behind the GPU)
  and with synchronous steps (`async_decode=False`: the GPU idles while the host builds the inputs,
  copies, samples, reads the tokens back and runs the scheduler); with `--gemv` also with the
  batch-1 Triton GEMV, with `--compile` also with torch.compile inside the graphs; and without
  graphs. For graphed steps also the replay alone (CUDA events around `graph.replay()`), so that
  wall - replay is the host time a step does not hide behind the GPU;
- the GPU kernel time of an eager step (torch.profiler), grouped (linear layers, LayerNorm,
  paged decode, fused elementwise, other), with kernel launches per step, and the kernels that
  take the most of it;
- the paged-decode split-KV sweep of one sparse and one dense layer over this batch's block
  tables: the time of one launch per split count (CUDA-graph replays), next to the count the
  heuristic picks (graph width and eager).
The floor: the weights read once at the copy rate, plus the KV pages each layer reads (per KV
group, the pages some head of the group needs: `layout.decode_pages`), which matter at batch 32.
`--json OUT` writes every number printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from torch.autograd import DeviceType

from sparsegen.commands.bench.common import graph_us
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model
from sparsegen.runner.cuda_graphs import width_bucket

GROUPS = (  # (label, substrings of kernel names), first match wins
    ("linear layers (GEMV/GEMM)", ("nvjet", "gemm", "gemv", "cublas", "splitkreduce", "cutlass")),
    ("paged decode", ("sparsegen_paged_decode", "paged_decode", "decode_reduce")),
    ("LayerNorm (+ residual add)", ("layer_norm", "add_layer_norm")),
    ("fused rotary/KV write, GeGeLU", ("rotary_qkv", "gegelu")),
    ("inductor kernels", ("triton_", "fused_")),
)
GIB = 2**30


def kv_bytes_needed(model, batch: int, context: int, steps: int) -> int:
    """KV cache bytes for `batch` sequences of context + steps tokens, with slack for pages."""
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    return int(batch * (context + 4 * steps + 64) * per_token * 1.05) + (256 << 20)


def engine_at(
    model, args, graphs: bool, compiled: bool = False, async_decode: bool = True, kv_layout: str = "head"
) -> LLMEngine:
    """An engine whose `args.batch` sequences have prefilled `args.context` tokens and taken 5
    decode steps (kernel compiles, torch.compile, CUDA-graph captures happen there)."""
    kv = kv_bytes_needed(model, args.batch, args.context, args.steps)
    engine = LLMEngine(model, kv_cache_bytes=kv, max_num_seqs=args.batch, max_num_batched_tokens=8192,
                       use_cuda_graphs=graphs, compile_model=compiled, async_decode=async_decode,
                       kv_layout=kv_layout)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
    seqs = engine.submit(prompts, SamplingParams(max_tokens=4 * args.steps + 8, ignore_eos=True))
    while any(s.t_first_token is None for s in seqs):  # prefill (chunked)
        engine.step()
    for _ in range(5):  # warm-up decode steps
        engine.step()
    sync()
    return engine


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(engine: LLMEngine, steps: int) -> float:
    """Wall ms per `step()` call. One untimed call first: after a synchronize nothing is in
    flight, and an async engine's first call would only read a step that is already done."""
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def replay_ms(engine: LLMEngine, n: int = 20) -> float | None:
    """GPU time of one replay of the graph the last step used (CUDA events), or None."""
    if engine.graphs is None or not engine.graphs.graphs:
        return None
    graph, _ = list(engine.graphs.graphs.values())[-1]  # captured last: the current bucket
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()  # rewrites the same cache slots with the same values: harmless here
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / n


def grouped(events, steps: int, groups=GROUPS) -> list[tuple[str, float, int]]:
    """(group, ms per step, kernels per step) from profiler key averages of device kernels."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA or e.self_device_time_total <= 0:
            continue  # CPU-side ops (aten::addmm...) also carry their kernels' time: count kernels once
        name = e.key.lower()
        label = next((g for g, keys in groups if any(k in name for k in keys)), "other (copies, adds, ...)")
        t = totals.setdefault(label, [0.0, 0])
        t[0] += e.self_device_time_total / 1e3 / steps
        t[1] += e.count / steps
    return sorted(((k, v[0], round(v[1])) for k, v in totals.items()), key=lambda r: -r[1])


def aten_ops_per_step(events, steps: int) -> list[tuple[str, int]]:
    """(aten op, calls per step), most called first: what a step launches, on any device."""
    rows = [(e.key, e.count // steps) for e in events if e.key.startswith("aten::") and e.count >= steps]
    return sorted(rows, key=lambda r: -r[1])


def kv_read_bytes(model, batch: int, seq_len: int, page_size: int = 16) -> int:
    """KV bytes one decode step reads at `seq_len` tokens per sequence: per layer and KV group,
    the pages that some head of the group needs (`sparsegen.layout.decode_pages`), K and V."""
    from sparsegen.layout import decode_pages

    cfg = model.config
    page_bytes = 2 * page_size * cfg.head_dim * model.dtype.itemsize  # K and V of one page, one KV head
    by_spec: dict[str, int] = {}
    total = 0
    for layer in model.spec.layers:
        key = layer.to_json()
        if key not in by_spec:
            by_spec[key] = int(decode_pages(layer, seq_len, page_size).sum())
        total += by_spec[key] * page_bytes
    return batch * total


def split_sweep(engine: LLMEngine) -> list[dict]:
    from sparsegen.kernels.decode import get_decode_kernel
    from sparsegen.kernels.families.decode import _sm_count, num_splits

    model, cache = engine.model, engine.cache
    seqs = engine.scheduler.running
    ps, dev = cache.page_size, model.device
    width = width_bucket(max(len(s.pages) for s in seqs), -(-engine.max_model_len // ps))
    wide = torch.full((len(seqs), width), cache.scratch_page, dtype=torch.int32, device=dev)
    for i, s in enumerate(seqs):
        wide[i, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32, device=dev)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=dev)
    eager_width = max(len(s.pages) for s in seqs)
    sms = _sm_count(dev)
    out = []
    for kind, idx in (("sparse", 0), ("dense", 1)):
        layer = model.spec.layers[idx]
        kern = get_decode_kernel(layer, dtype=model.dtype, page_size=ps)
        q = torch.randn(len(seqs), layer.num_heads, layer.head_dim, device=dev, dtype=model.dtype)
        rows = len(seqs) * (layer.num_heads // kern.heads_per_block)
        pick_graph = num_splits(rows, width * ps, sms)
        pick_eager = num_splits(rows, eager_width * ps, sms)
        sweep = {}
        for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
            kc, vc = cache.k[idx], cache.v[idx]
            sweep[s] = graph_us(lambda _i, s=s, kern=kern, q=q, kc=kc, vc=vc: kern.launch(q, kc, vc, wide, lens, 1 / 128,
                                                                                       splits=s))  # fmt: skip
        best = min(sweep, key=sweep.get)
        print(f"decode {kind} layer, {len(seqs)} x {int(lens.max())} tokens, us per launch by splits (CUDA-graph "
              f"replays, incl. the reduce): {' '.join(f'{s}:{t:.1f}' for s, t in sweep.items())}; best {best}; "
              f"heuristic picks {pick_graph} (graph width {width} pages), {pick_eager} (eager)")  # fmt: skip
        out.append({"kind": kind, "us_by_splits": sweep, "best": best, "pick_graph": pick_graph,
                    "pick_eager": pick_eager, "graph_width_pages": width})  # fmt: skip
    return out


def timed_engine(model, args, report: dict, name: str, compiled: bool, async_decode: bool = True) -> None:
    engine = engine_at(model, args, graphs=True, compiled=compiled, async_decode=async_decode)
    plans, forward = [], engine.runner.run
    engine.runner.run = lambda plan: (plans.append(plan.lookahead), forward(plan))[1]
    ms = step_ms(engine, args.steps)
    engine.runner.run = forward
    rep = replay_ms(engine)
    report[name] = {"step_ms": ms, "tokens_per_s": args.batch * 1e3 / ms, "replay_ms": rep,
                    "lookahead_steps": sum(plans), "steps": len(plans)}  # fmt: skip
    line = f"step with {name} ({sum(plans)} of {len(plans)} steps launched ahead): {ms:.2f} ms "
    line += f"({args.batch * 1e3 / ms:.1f} tok/s"
    if "floor_ms" in report:
        line += f", {report['floor_ms'] / ms:.0%} of the floor"
    line += ")"
    if rep is not None:
        line += f"; graph replay alone {rep:.2f} ms, host time not hidden {ms - rep:.2f} ms per step"
    else:
        line += "; no graph captured (CPU)"
    print(line, flush=True)
    del engine
    gc.collect()  # the next engine allocates its own KV cache (35 GB at batch 32)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile inside the graphs")
    ap.add_argument("--gemv", action="store_true", help="also time the graphs with the Triton GEMV (batch 1)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument(
        "--smoke", action="store_true", help="check the script on a CPU: tiny model, short prompts"
    )
    args = ap.parse_args()
    if args.batch < 1 or args.context < 1 or args.steps < 1:
        ap.error("--batch, --context and --steps must be >= 1")
    if args.smoke:
        size, device, dtype = "tiny", "cpu", torch.float32
        args.context = min(args.context, 200)
    elif torch.cuda.is_available():
        size, device, dtype = "7b", "cuda", torch.bfloat16
    else:
        raise SystemExit("profile_decode_step needs a CUDA GPU (or --smoke)")
    model = random_model(size, device=device, dtype=dtype, seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report: dict = {
        "size": size,
        "batch": args.batch,
        "context": args.context,
        "weights_gb": weight_bytes / 1e9,
    }
    if device == "cuda":
        from sparsegen.commands.bench.common import measure_ceilings

        bw = measure_ceilings().copy_tb_s * 1e12  # bytes read + written per second
        kv = kv_read_bytes(model, args.batch, args.context + 8)
        floor_ms = (weight_bytes + kv) / bw * 1e3
        report.update(copy_tb_s=bw / 1e12, weights_floor_ms=weight_bytes / bw * 1e3, kv_read_gb=kv / 1e9,
                      floor_ms=floor_ms)  # fmt: skip
        print(f"weights {weight_bytes / 1e9:.2f} GB + KV read per step {kv / 1e9:.2f} GB at the copy rate "
              f"{bw / 1e12:.2f} TB/s: floor {floor_ms:.2f} ms = {args.batch * 1e3 / floor_ms:.0f} tok/s "
              f"(weights alone {weight_bytes / bw * 1e3:.2f} ms)", flush=True)  # fmt: skip

    def save() -> None:  # after every part: a run stopped by its time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    timed_engine(model, args, report, "CUDA graphs", compiled=False)
    save()
    timed_engine(model, args, report, "CUDA graphs, sync steps", compiled=False, async_decode=False)
    save()
    if args.gemv:  # the Triton GEMV whatever the model's default (on for a GPU since session 8)
        default_gemv = model.gemv
        model.set_triton_gemv(True)
        timed_engine(model, args, report, "CUDA graphs + Triton GEMV", compiled=False)
        model.set_triton_gemv(default_gemv)
        save()
    if args.compile:
        timed_engine(model, args, report, "torch.compile in CUDA graphs", compiled=True)
        save()
    eager = engine_at(model, args, graphs=False)
    report["eager_step_ms"] = step_ms(eager, args.steps)
    print(f"step without graphs: {report['eager_step_ms']:.2f} ms", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, acc_events=True) as prof:
        for _ in range(args.steps):
            eager.step()
        sync()
    events = prof.key_averages()
    ops = aten_ops_per_step(events, args.steps)
    report["aten_ops_per_step"] = dict(ops)
    print(f"aten ops per eager step: {sum(n for _, n in ops)} "
          f"({', '.join(f'{k[6:]} {n}' for k, n in ops[:12])})")  # fmt: skip
    if device == "cuda":
        kernels = grouped(events, args.steps)
        total = sum(r[1] for r in kernels)
        report["kernel_ms_per_step"] = total
        report["kernels"] = [{"group": g, "ms": ms, "launches": n} for g, ms, n in kernels]
        print(
            f"GPU kernel time per eager step: {total:.2f} ms in {sum(r[2] for r in kernels)} kernel launches"
        )
        print("| what | GPU ms per step | kernels per step |\n|---|---|---|")
        for label, ms, count in kernels:
            print(f"| {label} | {ms:.3f} | {count} |")
        print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
        save()
        report["split_sweep"] = split_sweep(eager)
    save()


if __name__ == "__main__":
    main()
