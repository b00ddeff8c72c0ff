"""Where the time to first token goes: one prompt's prefill in the engine, timed and profiled.

    PYTHONPATH=$PWD python3 benchmarks/engine/profile_prefill.py --lengths 8192,32768 --json out.json
    PYTHONPATH=$PWD python3 benchmarks/engine/profile_prefill.py --smoke     # CPU: tiny model, plumbing only

For each prompt length, on one engine (random 7b weights, bf16, chunks of --chunk tokens, 8K by
default as in the engine):
- TTFT of the first prompt of that length and of a second one (a difference is one-time cost:
  library heuristics, new kernel specialisations), as `bench_generate.py` measures it;
- the GPU kernel time of a third prefill (torch.profiler), grouped as `profile_decode_step.py`
  groups a decode step, plus prefill attention, against the matmul FLOPs of the linear layers
  (2 x parameters x tokens) at the matmul ceiling measured in the same process;
- with `--host`, where one more call's wall time goes (`host_timeline.py`): a timeline of the
  stage boundaries of one `engine.generate` (host `perf_counter` and a CUDA event at each), a
  cProfile of another (top functions by tottime and cumtime), and on a GPU the SM clock and
  power draw sampled around a call that comes after 1 s of idle and one that comes right after
  0.3 s of matmuls (does the GPU start a prompt at a low clock?).

    PYTHONPATH=$PWD python3 benchmarks/engine/profile_prefill.py --lengths 8192,32768 --host --json out.json
    PYTHONPATH=$PWD python3 benchmarks/engine/profile_prefill.py --smoke --stand-in --host --lengths 8192,32768

`--profile-first` runs each length's first prompt under the timeline and cProfile too (its TTFT
is then not a clean number): where the first prompt's one-time cost goes.

`--stand-in` (with `--smoke`) replaces the prefill forward with one that returns zero logits, and
gives the tiny model 7b's LongRoPE and 128K positions: the engine's host work alone, at full
prompt lengths, on a CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import time
from dataclasses import replace

import host_timeline as ht
import torch
from profile_decode_step import GROUPS as DECODE_GROUPS
from profile_decode_step import grouped, sync
from torch.autograd import DeviceType

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import LongRopeConfig, named_config, random_model

GROUPS = (("prefill attention", ("prefill_kernel",)), *DECODE_GROUPS)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def ttft_s(engine: LLMEngine, length: int, seed: int) -> float:
    ids = prompt(length, seed)  # built before the clock starts: not part of the engine's TTFT
    sync()
    start = time.perf_counter()
    engine.generate([ids], ONE_TOKEN)
    sync()
    return time.perf_counter() - start


class StandInForward(torch.nn.Module):
    """The prefill forward replaced by zero logits for the sampled rows: what is left of a call is
    the engine's host work (checks, scheduling, batch building, copies, sampling, bookkeeping)."""

    def __init__(self, model):
        super().__init__()
        self.device, self.vocab = model.device, model.config.vocab_size

    def forward(self, ids, batch, kv_caches) -> torch.Tensor:  # [rows, vocab] float32
        rows = ids.shape[0] if batch.logits_index is None else batch.logits_index.shape[0]
        return torch.zeros(rows, self.vocab, device=self.device)


def tiny_long_config():
    """The tiny model with 7b's position range and LongRoPE (unit factors), for long host-only runs."""
    half = 32  # tiny head_dim 64
    return replace(named_config("tiny"), max_position_embeddings=131072,
                   rope_scaling=LongRopeConfig((1.0,) * half, (1.0,) * half, 8192, 1.0, 1.2))  # fmt: skip


def busy_gpu(seconds: float) -> None:
    """Keep the GPU at work for about `seconds` (bf16 matmuls), then wait for it."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def clock_run(engine: LLMEngine, ids: list[int], sampler: ht.ClockSampler, prelude) -> dict:
    """One timed call with the clock sampled from before `prelude` (idle or busy) to 0.1 s after it."""
    with sampler:
        prelude()
        sync()
        t0 = time.perf_counter()
        engine.generate([ids], ONE_TOKEN)
        sync()
        t1 = time.perf_counter()
        time.sleep(0.1)
    rows = sampler.table(t0, t1)
    sampler.samples.clear()
    during = sorted(r["sm_mhz"] for r in rows if r["phase"] == "during")
    before = [r["sm_mhz"] for r in rows if r["phase"] == "before"]
    return {
        "ttft_ms": (t1 - t0) * 1e3,
        "sm_mhz_last_before": before[-1] if before else None,
        "sm_mhz_during_min": during[0] if during else None,
        "sm_mhz_during_median": during[len(during) // 2] if during else None,
        "sm_mhz_during_max": during[-1] if during else None,
        "samples": rows,
    }


def first_call_report(engine: LLMEngine, n: int, cuda: bool) -> tuple[float, dict]:
    """--profile-first: the first prompt of this length under both the stage timeline and cProfile
    (its TTFT is then inflated by the profiler), to see where one-time costs go (new kernel
    specialisations compiling, library heuristics, first allocations of a size)."""
    ids = prompt(n, 2)
    tl, prof = ht.Timeline(cuda), cProfile.Profile()
    sync()
    start = time.perf_counter()
    with ht.instrumented(engine, tl):
        prof.enable()
        tl.mark("start")
        engine.generate([ids], ONE_TOKEN)
        tl.mark("returned")
        prof.disable()
    sync()
    elapsed = time.perf_counter() - start
    rows = tl.rows()
    out = {"timeline": rows, "summary": ht.summary(rows), "cprofile_cumtime": ht.top_functions(prof, "cumtime"),
           "cprofile_tottime": ht.top_functions(prof, "tottime")}  # fmt: skip
    print(f"  first call ({n} tokens) under the timeline and cProfile: {elapsed * 1e3:.1f} ms")
    ht.print_rows(rows)
    ht.print_functions(out["cprofile_cumtime"], "its cProfile, by cumtime:")
    return elapsed, out


def host_report(engine: LLMEngine, n: int, cuda: bool) -> dict:
    """--host: a stage timeline of one call, a cProfile of another, GPU clocks around two more."""
    out: dict = {}
    ids = prompt(n, 5)
    tl = ht.Timeline(cuda)
    sync()
    with ht.instrumented(engine, tl), ht.GcPauses() as pauses:
        tl.mark("start")
        engine.generate([ids], ONE_TOKEN)
        tl.mark("returned")
    rows = tl.rows()
    out["timeline"], out["summary"], out["gc"] = rows, ht.summary(rows), pauses.report()
    print(f"  host timeline of one call ({n} tokens; GPU ms: when the stream reached each mark):")
    ht.print_rows(rows)
    print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in out["summary"].items() if v is not None))  # fmt: skip
    print(
        "  Python gc during it: "
        + ", ".join(f"{g} {r['collections']}x {r['ms']:.2f} ms" for g, r in out["gc"].items())
    )

    ids = prompt(n, 6)
    prof = cProfile.Profile()
    sync()
    prof.enable()
    engine.generate([ids], ONE_TOKEN)
    sync()
    prof.disable()
    out["cprofile_tottime"] = ht.top_functions(prof, "tottime")
    out["cprofile_cumtime"] = ht.top_functions(prof, "cumtime")
    ht.print_functions(out["cprofile_tottime"], f"cProfile of one call ({n} tokens), by tottime:")
    ht.print_functions(out["cprofile_cumtime"], "by cumtime:")

    if not cuda:
        return out
    sampler = ht.ClockSampler(ht.gpu_index())
    out["clock_source"] = sampler.source
    if sampler.source is None:
        print("  GPU clocks: neither pynvml nor nvidia-smi is available; not sampled")
        return out

    def idle():
        time.sleep(1.0)

    def busy():
        busy_gpu(0.3)

    for label, prelude, seed in (("after 1 s idle", idle, 7), ("right after 0.3 s of matmuls", busy, 8)):
        run = clock_run(engine, prompt(n, seed), sampler, prelude)
        out.setdefault("clocks", {})[label] = run
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        print(f"  TTFT {label}: {run['ttft_ms']:.1f} ms; SM MHz last before {fmt(run['sm_mhz_last_before'])}, "
              f"during min/median/max {fmt(run['sm_mhz_during_min'])}/{fmt(run['sm_mhz_during_median'])}/"
              f"{fmt(run['sm_mhz_during_max'])} ({sampler.source}, {len(run['samples'])} samples)")  # fmt: skip
    print("  samples around the call after idle (t ms from the call's start, SM MHz, W):")
    for r in out["clocks"]["after 1 s idle"]["samples"]:
        if -150 <= r["t_ms"] <= out["clocks"]["after 1 s idle"]["ttft_ms"] + 60:
            print(f"    {r['t_ms']:8.1f} {r['sm_mhz']:6.0f} {r['power_w']:7.1f}  {r['phase']}")
    return out


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
    ap.add_argument("--host", action="store_true", help="also: stage timeline, cProfile, GPU clocks")
    ap.add_argument("--profile-first", action="store_true",
                    help="run each length's first prompt under the timeline and cProfile (one-time costs)")  # fmt: skip
    ap.add_argument("--stand-in", action="store_true",
                    help="with --smoke: zero-logit stand-in forward, full lengths (host work only)")  # fmt: skip
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.stand_in and not args.smoke:
        ap.error("--stand-in is a CPU measurement: give --smoke too")
    if args.smoke:
        size, device, dtype = "tiny", "cpu", torch.float32
        if not args.stand_in:
            lengths = [min(n, 96) for n in lengths]
    elif torch.cuda.is_available():
        size, device, dtype = "7b", "cuda", torch.bfloat16
    else:
        raise SystemExit("profile_prefill needs a CUDA GPU (or --smoke)")
    model = random_model(tiny_long_config() if args.stand_in else size, device=device, dtype=dtype, seed=0)
    params = sum(p.numel() for p in model.parameters())
    report: dict = {
        "size": size,
        "params": params,
        "chunk": args.chunk,
        "stand_in": args.stand_in,
        "runs": [],
    }
    ceiling = None
    if device == "cuda":
        from sparsegen.commands.bench.common import measure_ceilings

        ceiling = measure_ceilings().matmul_tflop_s
        report["matmul_tflops"] = ceiling
    kv = (24 << 30) if device == "cuda" else (256 << 20)
    for n in lengths:
        engine = LLMEngine(model, kv_cache_bytes=kv, max_num_seqs=4, max_num_batched_tokens=args.chunk,
                           use_cuda_graphs=device == "cuda")  # fmt: skip
        engine.generate([prompt(512, 1)], SamplingParams(max_tokens=2, ignore_eos=True))  # as bench_generate
        if args.stand_in:
            engine.runner.model = StandInForward(model)  # after the warm-up: decode keeps the model
        first_call = None
        if args.profile_first:
            first, first_call = first_call_report(engine, n, device == "cuda")
        else:
            first = ttft_s(engine, n, 2)
        second = ttft_s(engine, n, 3)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            ttft_s(engine, n, 4)
        run = {"length": n, "ttft_first_ms": first * 1e3, "ttft_second_ms": second * 1e3}
        if first_call is not None:
            run["first_call"] = first_call  # ttft_first_ms was then measured under the profiler
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
        if args.host:
            run["host"] = host_report(engine, n, device == "cuda")
        report["runs"].append(run)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        del engine


if __name__ == "__main__":
    main()
