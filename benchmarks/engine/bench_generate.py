"""End-to-end random weights of a named size (Phi-3-Small `7b` by default, bf16) through the engine:
the model's own attention vs every layer forced dense.

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate.py [--out generate.json] [--quick] [--compile both]
                                                         [--gemv both] [--random mistral-7b] [--dense-attention]
                                                         [--only decode_b1,ttft_32k]
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate.py --smoke   # CPU, tiny model, short prompts
    # issue 31's window-vs-dense rows, both modes in one process (a few minutes: split with --only)
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate.py --random mistral-7b --quick --only decode_b1,ttft_32k

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
- `--random` (or `--size`) picks the model: `7b` or a family preset (mistral-7b, llama3-8b,
  qwen2-7b, gemma2-9b, gpt-oss-20b; `models.families.PRESETS`). The mode `dense` builds each
  engine with `EngineConfig.dense_attention` (every layer dense causal, its soft-cap, sinks and
  scale kept); `--dense-attention` measures that mode alone (`--modes dense`), and the default
  measures both in this process. A model whose context is shorter than a prompt length measures
  it at its context less a margin;
- at batch 1 on a GPU, the step's floor: the weights one step reads (all but the embedding
  table; of a mixture of experts only the routed top-k of every layer's experts) plus the KV
  pages each layer reads at that context (`profile_decode_step.kv_read_bytes`), at the copy rate
  measured in this process, and the step's share of it (`floor %`);
- `--only` measures a subset (ttft_8k, ttft_32k, decode_b1, decode_b32), to keep a call short;
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
    dense_attention: bool = False  # EngineConfig.dense_attention: every layer forced dense


def new_engine(model, setup: Setup) -> LLMEngine:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    kv_bytes = int(setup.kv_gib * GIB) if model.device.type == "cuda" else (64 << 20)
    chunks = {} if setup.chunk is None else {"max_num_batched_tokens": setup.chunk}
    model.set_force_dense(False)  # the engine forces it dense again with dense_attention
    return LLMEngine(model, kv_cache_bytes=kv_bytes, max_num_seqs=32, use_cuda_graphs=setup.graphs,
                     compile_model=setup.compiled, kv_cache_dtype=setup.kv_cache_dtype,
                     dense_attention=setup.dense_attention, **chunks)  # fmt: skip


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


MEASURES = ("ttft_8k", "ttft_32k", "decode_b1", "decode_b32")


def step_weight_bytes(model) -> int:
    """Weight bytes one batch-1 decode step reads: every parameter but the embedding table (one
    row of it is read; a tied lm_head reads it whole), and of a mixture of experts only the
    top-k experts of each layer."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    cfg = model.config
    if getattr(cfg, "num_experts", 0):
        experts = sum(p.numel() * p.element_size() for layer in model.model.layers
                      for p in layer.mlp.experts.parameters())  # fmt: skip
        total -= experts * (cfg.num_experts - cfg.experts_per_tok) // cfg.num_experts
    return total


def floor_of(model, row: dict, copy_tb_s: float | None, mode: str) -> dict:
    """The batch-1 step's weight + KV read floor at the copy rate, and the step's share of it."""
    from profile_decode_step import kv_read_bytes

    model.set_force_dense(mode == "dense")  # the layers the engine ran (kv_read_bytes reads model.spec)
    kv = kv_read_bytes(model, 1, row["context"] + row["steps_before"])
    weights = step_weight_bytes(model)
    floor_ms = (weights + kv) / (copy_tb_s * 1e12) * 1e3
    return {"weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "copy_tb_s": copy_tb_s, "floor_ms": floor_ms,
            "floor_pct": 100 * floor_ms / row["step_ms"]}  # fmt: skip


def run_mode(model, mode: str, name: str, compiled: bool, args, sizes, kv_cache_dtype: str = "auto",
             copy_tb_s: float | None = None) -> dict:  # fmt: skip
    short, long, big_batch, steps, warm = sizes
    setup = Setup(graphs=not args.no_cuda_graphs, compiled=compiled, kv_gib=args.kv_gib, chunk=args.chunk,
                  kv_cache_dtype=kv_cache_dtype, dense_attention=mode == "dense")  # fmt: skip
    runs = {
        "ttft_8k": lambda: ttft(model, short, setup),
        "ttft_32k": lambda: ttft(model, long, setup),
        "decode_b1": lambda: decode_rate(model, 1, short, steps, warm, setup),
        "decode_b32": lambda: decode_rate(model, big_batch, short, steps, warm, setup),
    }
    r = {key: runs[key]() for key in MEASURES if key in args.only}
    if "decode_b1" in r and copy_tb_s is not None:
        r["decode_b1"]["floor"] = floor_of(
            model, {**r["decode_b1"], "steps_before": warm + 2}, copy_tb_s, mode
        )
    parts = [f"{name:20s}", "forced dense" if mode == "dense" else "own attention"]
    if "ttft_8k" in r:
        parts.append(f"TTFT {short} {r['ttft_8k']['ttft_s'] * 1e3:8.1f} ms")
    if "ttft_32k" in r:
        parts.append(f"TTFT {long} {r['ttft_32k']['ttft_s'] * 1e3:8.1f} ms")
    if "decode_b1" in r:
        b1 = r["decode_b1"]
        parts.append(f"b1 {b1['tokens_per_s']:7.1f} tok/s ({b1['step_ms']:.2f} ms/step)")
        if "floor" in b1:
            f = b1["floor"]
            parts.append(f"floor {f['floor_ms']:.2f} ms = {f['floor_pct']:.1f} % (weights {f['weights_gb']:.2f} GB + "
                         f"KV {f['kv_gb']:.3f} GB at {f['copy_tb_s']:.2f} TB/s)")  # fmt: skip
    if "decode_b32" in r:
        bb = r["decode_b32"]
        parts.append(f"b{big_batch} {bb['tokens_per_s']:8.1f} tok/s ({bb['step_ms']:.2f} ms/step)")
    kv = next(iter(r.values()))["kv"]
    parts.append(f"KV {kv['pages']} pages = {kv['tokens']} tokens ({kv['gib']:.1f} GiB)  "
                 f"peak {max(x['peak_gib'] for x in r.values()):.1f} GiB")  # fmt: skip
    print("  ".join(parts), flush=True)
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
        "--random",
        dest="size",
        default="7b",
        choices=RANDOM_NAMES,
        help="random weights of this named size (a family preset, or Phi-3-Small's 7b)",
    )
    ap.add_argument(
        "--dense-attention",
        action="store_true",
        help="measure only the model forced dense (EngineConfig.dense_attention; same as --modes dense)",
    )
    ap.add_argument("--only", default=",".join(MEASURES),
                    help=f"comma-separated measurements, of {', '.join(MEASURES)} (default: all)")  # fmt: skip
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
    if args.dense_attention:
        args.modes = "dense"
    args.only = args.only.split(",")
    bad = sorted(set(args.only) - set(MEASURES)) + sorted(set(args.modes.split(",")) - {"sparse", "dense"})
    if bad or not args.only:
        ap.error(f"unknown measurement or mode {bad}; --only takes {MEASURES}, --modes sparse and dense")
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
    copy_tb_s = None
    if device == "cuda":
        from sparsegen.commands.bench.common import measure_ceilings

        copy_tb_s = measure_ceilings().copy_tb_s
        print(f"copy rate {copy_tb_s:.2f} TB/s (2 GiB buffers, this process)", flush=True)
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
                rows[name] = run_mode(model, mode, name, compiled, args, sizes, kv_dtype, copy_tb_s)
                save()
    model.set_triton_gemv(default_gemv)
    if "sparse" in rows and "dense" in rows:
        s, d = rows["sparse"], rows["dense"]
        print(f"== summary ({size} random, {dtype}, {short}-token prompts for decode; the model's own "
              "attention, speed-up over the same model forced dense)")  # fmt: skip
        out = []
        if "ttft_8k" in s:
            out.append(f"TTFT {short} x{d['ttft_8k']['ttft_s'] / s['ttft_8k']['ttft_s']:.2f}")
        if "ttft_32k" in s:
            out.append(f"TTFT {long} x{d['ttft_32k']['ttft_s'] / s['ttft_32k']['ttft_s']:.2f}")
        for key, b in (("decode_b1", 1), ("decode_b32", big_batch)):
            if key in s:
                out.append(f"decode b{b} x{s[key]['tokens_per_s'] / d[key]['tokens_per_s']:.2f}")
        print("   ".join(out))


if __name__ == "__main__":
    main()
