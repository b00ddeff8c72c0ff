"""End-to-end random weights of a named size (Phi-3-Small `7b` by default, bf16) through the engine:
the model's own attention vs every layer dense.

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate.py [--out generate.json] [--quick] [--compile both]
                                                         [--gemv both] [--size mistral-7b] [--modes dense]
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate.py --smoke   # CPU, tiny model, short prompts

In one run, with the same weights, for sparse attention and for every layer dense (and, with
`--compile both`, for decode steps with and without torch.compile inside the CUDA graphs; with
`--gemv both`, with cuBLAS and with the batch-1 Triton GEMV; by default the model's own choice,
the GEMV on a GPU since session 8):
- time to first token of one 8K-token and one 32K-token prompt (prefill chunks of the engine's
  default size, or `--chunk` tokens),
  each after a warm-up prompt of the same length on the same engine (compiles stay out);
- decode tokens/s and ms/step at batch 1 and at batch 32, each sequence with an 8K-token
  prompt. Only decode steps are timed (from the step after every sequence has its first
  token), after a few warm-up steps (kernel compiles and CUDA-graph captures happen before
  the timed window);
- `--size` picks the model: `7b` or a family preset (mistral-7b, llama3-8b, qwen2-7b, gemma2-9b,
  gpt-oss-20b; `models.families.PRESETS`); `--modes dense` alone forces every layer dense. A
  model whose context is shorter than a prompt length measures it at its context less a margin;
- the KV cache each engine allocated (pages, tokens, GiB) and the peak GPU memory of each
  measurement (torch.cuda.max_memory_allocated, weights included);
- `--kv-cache-dtype fp8` builds every engine with an fp8 KV cache (same `--kv-gib` budget, so
  twice the tokens); `--kv-cache-dtype both` measures each mode with the model's dtype and then
  with fp8 in the same process (rows `MODE+fp8`).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass

import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model
from sparsegen.models.families import RANDOM_NAMES, random_config
from sparsegen.runner.config import KV_CACHE_DTYPES

GIB = 2**30


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0


@dataclass(frozen=True)
class Setup:
    """How each measurement's engine is built."""

    graphs: bool  # decode steps replay CUDA graphs
    compiled: bool  # torch.compile inside them
    kv_gib: float  # KV cache budget (GPU)
    chunk: int | None  # prefill tokens per step; None: the engine's default
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: "auto" (the model's) or an fp8 name


def new_engine(model, setup: Setup) -> LLMEngine:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    kv_bytes = int(setup.kv_gib * GIB) if model.device.type == "cuda" else (64 << 20)
    chunks = {} if setup.chunk is None else {"max_num_batched_tokens": setup.chunk}
    return LLMEngine(model, kv_cache_bytes=kv_bytes, max_num_seqs=32, use_cuda_graphs=setup.graphs,
                     compile_model=setup.compiled, kv_cache_dtype=setup.kv_cache_dtype, **chunks)  # fmt: skip


def kv_info(engine: LLMEngine) -> dict:
    pages, tokens = engine.kv_capacity
    return {"pages": pages, "tokens": tokens, "gib": engine.runner.kv_cache_bytes / GIB}


def ttft(model, length: int, setup: Setup) -> dict:
    engine = new_engine(model, setup)
    # Warm-up with another prompt of the same length: the prefill kernels are specialised per
    # length bucket and cuBLAS picks per shape, so a first prompt of a new length also times JIT
    # compiles (a fresh H200 in session 6 measured 544.7 ms for the first 8K prompt, 197 warm).
    engine.generate(prompts(1, length, seed=1), SamplingParams(max_tokens=2, ignore_eos=True))
    sync()
    res = engine.generate(prompts(1, length, seed=2), SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return {"ttft_s": res.metrics.ttft_s, "context": length, "chunk": engine.config.max_num_batched_tokens,
            "peak_gib": peak_gib(), "kv": kv_info(engine)}  # fmt: skip


def decode_rate(model, batch: int, length: int, steps: int, warm_steps: int, setup: Setup) -> dict:
    engine = new_engine(model, setup)
    params = SamplingParams(max_tokens=steps + warm_steps + 2, ignore_eos=True)
    seqs = engine.submit(prompts(batch, length, seed=3), params)
    while any(s.t_first_token is None for s in seqs):  # prefill every prompt
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    sync()
    engine.step()  # untimed: the step left in flight (async_decode, the default) is done by now
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += len(engine.step())  # each call reads one step's tokens back
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens / wall, "step_ms": 1e3 * wall / steps, "batch": batch, "context": length,
            "peak_gib": peak_gib(), "kv": kv_info(engine)}  # fmt: skip


def run_mode(model, mode: str, name: str, compiled: bool, args, sizes, kv_cache_dtype: str = "auto") -> dict:
    short, long, big_batch, steps, warm = sizes
    setup = Setup(graphs=not args.no_cuda_graphs, compiled=compiled, kv_gib=args.kv_gib, chunk=args.chunk,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    model.set_force_dense(mode == "dense")
    r = {
        "ttft_8k": ttft(model, short, setup),
        "ttft_32k": ttft(model, long, setup),
        "decode_b1": decode_rate(model, 1, short, steps, warm, setup),
        "decode_b32": decode_rate(model, big_batch, short, steps, warm, setup),
    }
    kv = r["decode_b1"]["kv"]
    print(
        f"{name:20s} TTFT {short} {r['ttft_8k']['ttft_s'] * 1e3:8.1f} ms  TTFT {long} {r['ttft_32k']['ttft_s'] * 1e3:8.1f} ms  "
        f"b1 {r['decode_b1']['tokens_per_s']:7.1f} tok/s ({r['decode_b1']['step_ms']:.2f} ms/step)  "
        f"b{big_batch} {r['decode_b32']['tokens_per_s']:8.1f} tok/s ({r['decode_b32']['step_ms']:.2f} ms/step)  "
        f"KV {kv['pages']} pages = {kv['tokens']} tokens ({kv['gib']:.1f} GiB)  "
        f"peak {max(x['peak_gib'] for x in r.values()):.1f} GiB",
        flush=True,
    )  # fmt: skip
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer decode steps")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="decode steps through torch.compile inside the graphs (both: measure each)")  # fmt: skip
    ap.add_argument(
        "--modes",
        default="sparse,dense",
        help="comma-separated: sparse (the model's own attention), dense (every layer forced dense)",
    )
    ap.add_argument(
        "--size",
        default="7b",
        choices=RANDOM_NAMES,
        help="random weights of this named size (a family preset, or Phi-3-Small's 7b)",
    )
    ap.add_argument("--gemv", choices=["default", "off", "on", "both"], default="default",
                    help="batch-1 linear layers through the Triton GEMV (ModelOptions.triton_gemv; "
                         "default: the model's own choice, on for a GPU)")  # fmt: skip
    ap.add_argument("--kv-gib", type=float, default=48.0, help="KV cache budget per engine (GPU)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill tokens per step (default: the engine's)")
    ap.add_argument("--kv-cache-dtype", choices=[*KV_CACHE_DTYPES, "both"], default="auto",
                    help="the KV cache's dtype; 'both': every mode with the model's dtype, then with fp8 "
                    "(rows named MODE+fp8), in this process")  # fmt: skip
    ap.add_argument(
        "--smoke", action="store_true", help="check the script on a CPU: tiny model, short prompts"
    )
    args = ap.parse_args()
    flags = {"off": [False], "on": [True], "both": [False, True]}
    gemv_flags = {"default": [None], **flags}
    # torch.compile traces the plain linear layers (the GEMV is an eager kernel): no compile+gemv run
    combos = [(c, g) for g in gemv_flags[args.gemv] for c in flags[args.compile] if not (c and g)]
    if not combos:
        ap.error("--compile on with --gemv on measures nothing: compiled steps do not use the GEMV")
    steps, warm = (16, 3) if args.quick or args.smoke else (64, 4)
    short, long, big_batch = (8192, 32768, 32) if not args.smoke else (512, 1024, 4)
    if args.smoke:
        size, device, dtype = "tiny", "cpu", torch.float32
    elif torch.cuda.is_available():
        size, device, dtype = args.size, "cuda", torch.bfloat16
    else:
        raise SystemExit("bench_generate needs a CUDA GPU (or --smoke)")
    if args.smoke and args.size != "7b":
        ap.error("--smoke runs the tiny model; --size needs a GPU")
    context = random_config(size).max_position_embeddings - 2 * (steps + warm) - 64  # decode room
    if long > context:
        print(f"{size} holds {context + 2 * (steps + warm) + 64} positions: prompts capped at {context}")
        short, long = min(short, context), context
    t0 = time.perf_counter()
    model = random_model(size, device=device, dtype=dtype, seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{size} random weights ({weights / 1e9:.2f} GB) built in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    rows = {}

    def save() -> None:  # after every run: a call stopped by its time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"size": size, "cuda_graphs": not args.no_cuda_graphs, "weights_gb": weights / 1e9,
                           **rows}, f, indent=2)  # fmt: skip

    default_gemv = model.gemv
    for compiled, gemv in combos:
        model.set_triton_gemv(default_gemv if gemv is None else gemv)
        suffix = "" if gemv is None else "+gemv" if gemv else "+cublas"
        kv_dtypes = ["auto", "fp8"] if args.kv_cache_dtype == "both" else [args.kv_cache_dtype]
        for mode in args.modes.split(","):
            for kv_dtype in kv_dtypes:
                kv_suffix = "" if kv_dtype == "auto" else f"+{kv_dtype}"
                name = f"{mode}{'+compile' if compiled else ''}{suffix}{kv_suffix}"
                sizes = (short, long, big_batch, steps, warm)
                rows[name] = run_mode(model, mode, name, compiled, args, sizes, kv_dtype)
                save()
    model.set_triton_gemv(default_gemv)
    if "sparse" in rows and "dense" in rows:
        s, d = rows["sparse"], rows["dense"]
        print(
            f"== summary ({size} random, {dtype}, {short}-token prompts for decode; sparse speed-up over dense)"
        )
        print(f"TTFT {short} x{d['ttft_8k']['ttft_s'] / s['ttft_8k']['ttft_s']:.2f}   "
              f"TTFT {long} x{d['ttft_32k']['ttft_s'] / s['ttft_32k']['ttft_s']:.2f}   "
              f"decode b1 x{s['decode_b1']['tokens_per_s'] / d['decode_b1']['tokens_per_s']:.2f}   "
              f"decode b{big_batch} x{s['decode_b32']['tokens_per_s'] / d['decode_b32']['tokens_per_s']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
