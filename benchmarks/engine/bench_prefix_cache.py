"""TTFT of a chat load with a shared system prompt, automatic prefix caching on against off (GPU).

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_prefix_cache.py --random 7b [--clients 16]
        [--system 2048] [--question 64] [--requests 4] [--max-tokens 32] [--json OUT]
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_prefix_cache.py --smoke   # CPU plumbing check

`--clients` closed-loop clients share one engine: each sends a request (the shared
`--system`-token system prompt, then a `--question` of its own random tokens), waits for its
`--max-tokens` tokens, and sends its next, `--requests` times. One engine per mode (random
weights, bf16 on the GPU): caching off (`enable_prefix_caching=False`) and on. Before the timed
load each engine serves one warm-up request with the system prompt, as a server that has been
up a while has (with caching on, that request puts the system prompt's pages in the cache).
Per mode: TTFT median / p90 / max over every request (the engine's `t_first_token - t_submit`,
so queueing behind other clients' prefills counts), the prompt tokens the cache served, the
load's wall time and its output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model


def tokens(n: int, gen: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(0, min(vocab, 32000), (n,), generator=gen).tolist()


def load(engine: LLMEngine, args, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    system = tokens(args.system, gen, vocab)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate([system + tokens(args.question, gen, vocab)], params)  # warm-up / cache primer
    hits0 = engine.scheduler.prefix_counters.hits
    left = {c: args.requests for c in range(args.clients)}
    live, done = {}, []

    def send(client: int) -> None:
        left[client] -= 1
        seq = engine.add_request(system + tokens(args.question, gen, vocab), params, index=client)
        live[seq.seq_id] = seq

    start = time.perf_counter()
    for c in range(args.clients):
        send(c)
    out_tokens = 0
    while engine.has_unfinished:
        for e in engine.step():
            out_tokens += 1
            if e.finish_reason is not None:
                seq = live.pop(e.request_id)
                done.append(seq)
                if left[e.index]:
                    send(e.index)
    wall = time.perf_counter() - start
    ttft = sorted((s.t_first_token - s.t_submit) * 1e3 for s in done)
    return {
        "requests": len(done),
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "ttft_ms_max": ttft[-1],
        "cached_prompt_tokens": engine.scheduler.prefix_counters.hits - hits0,
        "prompt_tokens": len(done) * (args.system + args.question),
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", default="7b", choices=("tiny", "7b"), help="random weights of this size")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--system", type=int, default=2048, help="tokens of the shared system prompt")
    ap.add_argument("--question", type=int, default=64, help="tokens of each request's own part")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-gib", type=float, default=16.0)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small load")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name in ("clients", "system", "question", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.kv_cache_gib > 0:
        ap.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.smoke:
        args.random, args.clients, args.system, args.question = "tiny", 4, 100, 8
        args.requests, args.max_tokens, args.kv_cache_gib = 2, 4, 0.01
        device, dtype = "cpu", torch.float32
    elif not torch.cuda.is_available():
        raise SystemExit("bench_prefix_cache.py needs a CUDA GPU (or --smoke)")
    else:
        device, dtype = "cuda", torch.bfloat16
    model = random_model(args.random, device=device, dtype=dtype, seed=0)
    vocab = model.config.vocab_size
    results = {}
    for mode, caching in (("off", False), ("on", True)):
        engine = LLMEngine(
            model,
            kv_cache_bytes=int(args.kv_cache_gib * 2**30),
            max_num_seqs=args.clients,
            enable_prefix_caching=caching,
        )
        results[mode] = load(engine, args, vocab)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"{args.clients} clients x {args.requests} requests, system {args.system} + question "
          f"{args.question} tokens, {args.max_tokens} new tokens, random {args.random}")  # fmt: skip
    print(f"{'caching':>8} {'TTFT med ms':>12} {'p90 ms':>9} {'max ms':>9} {'cached tok':>11} {'tok/s':>9}")
    for mode, r in results.items():
        print(f"{mode:>8} {r['ttft_ms_median']:12.1f} {r['ttft_ms_p90']:9.1f} {r['ttft_ms_max']:9.1f} "
              f"{r['cached_prompt_tokens']:11d} {r['output_tokens_per_s']:9.1f}")  # fmt: skip
    speedup = results["off"]["ttft_ms_median"] / max(results["on"]["ttft_ms_median"], 1e-9)
    print(f"median TTFT off / on: {speedup:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
