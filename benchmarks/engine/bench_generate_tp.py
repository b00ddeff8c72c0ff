"""End-to-end Phi-3-Small (random `7b` weights, bf16) at several tensor-parallel sizes, one run.

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate_tp.py --tp 1 2 [--quick] [--out tp.json]
    PYTHONPATH=$PWD python3 benchmarks/engine/bench_generate_tp.py --smoke   # CPU (gloo), tiny model

Every size runs through the tensor-parallel executor (`MultiprocExecutor`; TP=1 too: one rank
process), so the sizes differ only in the split. On each rank the measurements are `bench_generate.py`'s: TTFT of one 8K and one
32K-token prompt, and decode tokens/s at batch 1 and batch 32 with 8K-token prompts, CUDA-graph
replays, after warm-up steps. Rank 0's clock is reported. Targets (issue 15): batch-32 decode
at TP=2 >= 1.8x TP=1; batch-1 step time at TP=2 <= 0.6x TP=1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_generate, in the ranks too

from sparsegen.parallel.executor import MultiprocExecutor  # noqa: E402
from sparsegen.parallel.source import ModelSource  # noqa: E402
from sparsegen.runner.config import EngineConfig  # noqa: E402


def measure(
    ctx, short: int, long: int, big_batch: int, steps: int, warm: int, graphs: bool, kv_gib: float
) -> dict:
    """On every rank, in lockstep: bench_generate's measurements over this rank's shard."""
    from bench_generate import Setup, decode_rate, ttft

    model, setup = ctx.model, Setup(graphs=graphs, compiled=False, kv_gib=kv_gib, chunk=None)
    return {
        "ttft_8k_s": ttft(model, short, setup)["ttft_s"],
        "ttft_32k_s": ttft(model, long, setup)["ttft_s"],
        "decode_b1": decode_rate(model, 1, short, steps, warm, setup),
        "decode_b32": decode_rate(model, big_batch, short, steps, warm, setup),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, in order")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer decode steps")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--kv-gib", type=float, default=48.0, help="KV cache budget per rank (GPU)")
    ap.add_argument("--smoke", action="store_true", help="check the script on a CPU: tiny model, gloo")
    args = ap.parse_args()
    graphs = not args.no_cuda_graphs
    steps, warm = (16, 3) if args.quick or args.smoke else (64, 4)
    short, long, big_batch = (8192, 32768, 32) if not args.smoke else (256, 512, 4)
    if args.smoke:
        source, device = ModelSource(random="tiny", dtype="float32"), "cpu"
    elif torch.cuda.is_available():
        source, device = ModelSource(random="7b", dtype="bfloat16"), "cuda"
    else:
        raise SystemExit("bench_generate_tp needs CUDA GPUs (or --smoke)")
    rows = {}
    for tp in args.tp:
        t0 = time.perf_counter()
        max_model_len = source.load_config().max_position_embeddings
        ranks = MultiprocExecutor(source, EngineConfig(tensor_parallel_size=tp), max_model_len=max_model_len,
                                  device_type=device)  # fmt: skip
        try:
            print(f"TP={tp}: {tp} rank(s) up with {source.random} weights in {time.perf_counter() - t0:.1f} s",
                  flush=True)  # fmt: skip
            r = ranks.call(measure, short, long, big_batch, steps, warm, graphs, args.kv_gib)
        finally:
            ranks.close()
        rows[tp] = r
        print(
            f"TP={tp}  TTFT {short} {r['ttft_8k_s'] * 1e3:8.1f} ms   TTFT {long} {r['ttft_32k_s'] * 1e3:8.1f} ms   "
            f"decode b1 {r['decode_b1']['tokens_per_s']:7.1f} tok/s ({r['decode_b1']['step_ms']:.2f} ms/step)   "
            f"decode b{big_batch} {r['decode_b32']['tokens_per_s']:8.1f} tok/s "
            f"({r['decode_b32']['step_ms']:.2f} ms/step)",
            flush=True,
        )
    base = rows[args.tp[0]]
    for tp, r in rows.items():
        if tp == args.tp[0]:
            continue
        print(
            f"== TP={tp} vs TP={args.tp[0]}: decode b{big_batch} x{r['decode_b32']['tokens_per_s'] / base['decode_b32']['tokens_per_s']:.2f} "
            f"(target >= 1.8 at TP=2), b1 step time x{r['decode_b1']['step_ms'] / base['decode_b1']['step_ms']:.2f} "
            f"(target <= 0.6 at TP=2), TTFT {short} x{r['ttft_8k_s'] / base['ttft_8k_s']:.2f}, "
            f"TTFT {long} x{r['ttft_32k_s'] / base['ttft_32k_s']:.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"size": source.random, "cuda_graphs": graphs, "tp": rows}, f, indent=2)


if __name__ == "__main__":
    main()
