"""Does warming L2 with a weight (`models.l2_prefetch`) speed up the batch-1 GEMV that follows? (GPU)

    PYTHONPATH=$PWD python3 benchmarks/bench_l2_prefetch.py [--json OUT] [--plans ...] [--batch 1,32]

Part 1, one linear layer of the 7b model at batch 1 (bf16, cuBLAS through F.linear), CUDA-graph
replays over a ring of weight copies several times L2, so that every call starts cold:
- `gemv`: the GEMV alone; `sleep`: a ~15 us spin kernel alone (it stands for the latency-bound
  kernels of a decode step: rotary, paged decode, norms) and `sleep+gemv`;
- `pf+sleep+gemv`: the prefetch of the whole weight first, per chunk size and eviction hint;
  `pf+gemv` with no sleep between, and `pf` alone (its own cost in the stream).
  gemv time hidden = (sleep+gemv) - (pf+sleep+gemv).
Part 2, the engine: a decode step of Phi-3-Small 7b (random weights, 8K prompts) per
`L2Prefetch` plan, each in an engine of its own (graphs captured with the plan): wall ms per
step (async steps, as the engine runs by default) and graph replay alone, plus a check that the
greedy tokens equal those of the plan-less engine.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from sparsegen.bench.common import graph_us

LAYERS = {  # name: (out, in) of the 7b model's linear layers
    "o": (4096, 4096),
    "qkv": (6144, 4096),
    "down": (4096, 14336),
    "up": (28672, 4096),
}
SLEEP_CYCLES = 30_000  # ~15 us at the H200's ~1.98 GHz
L2_RING_BYTES = 400 << 20  # the ring of copies: 8x the 50 MB L2


def layer_row(name: str) -> dict:
    """Part 1 for one linear layer."""
    from sparsegen.models import l2_prefetch

    dev, dt = "cuda", torch.bfloat16
    n, k = LAYERS[name]
    nbytes = n * k * 2
    ring = max(4, math.ceil(L2_RING_BYTES / nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(ring)]  # [n, k] each
    bs = [torch.randn(n, device=dev, dtype=dt) for _ in range(ring)]
    x = torch.randn(1, k, device=dev, dtype=dt)  # [1, k]

    def variant(pf: bool, slp: bool, mm: bool, chunk: int = l2_prefetch.CHUNK, ev: bool = False):
        def fn(i):
            if pf:
                l2_prefetch.prefetch(ws[i % ring], evict_last=ev, chunk=chunk)
            if slp:
                torch.cuda._sleep(SLEEP_CYCLES)
            if mm:
                F.linear(x, ws[i % ring], bs[i % ring])

        return fn

    calls = 2 * ring
    r = {"layer": name, "mb": nbytes / 2**20, "ring": ring}
    r["gemv"] = graph_us(variant(False, False, True), calls=calls)
    r["sleep"] = graph_us(variant(False, True, False), calls=calls)
    r["sleep+gemv"] = graph_us(variant(False, True, True), calls=calls)
    for chunk in (4096, 16384, 65536):
        for ev in (False, True):
            tag = f"pf{chunk // 1024}k{'_ev' if ev else ''}"
            r[f"{tag}+sleep+gemv"] = graph_us(variant(True, True, True, chunk, ev), calls=calls)
    r["pf16k+gemv"] = graph_us(variant(True, False, True), calls=calls)
    r["pf16k"] = graph_us(variant(True, False, False), calls=calls)
    r["pf16k+sleep"] = graph_us(variant(True, True, False), calls=calls)
    r["gemv_hot"] = graph_us(lambda i: F.linear(x, ws[0], bs[0]), calls=calls)  # one weight: from L2
    keys = [key for key in r if key not in ("layer", "mb", "ring")]
    print(f"{name} [{n}x{k}] {nbytes / 2**20:.1f} MB, ring {ring}: "
          + ", ".join(f"{key} {r[key]:.1f}" for key in keys) + " us", flush=True)  # fmt: skip
    return r


def part1(names: list[str]) -> list[dict]:
    print(f"L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MB", flush=True)
    rows = []
    for name in names:
        rows.append(layer_row(name))
        torch.cuda.empty_cache()
    return rows


def parse_plan(text: str):
    """'off', or comma-separated field=megabytes of L2Prefetch (inf allowed) and ev=0/1."""
    from sparsegen.models.options import L2Prefetch

    if text == "off":
        return None
    kw: dict = {"o_at_attn": 0.0}
    for part in text.split(","):
        key, val = part.split("=")
        if key == "ev":
            kw["evict_last"] = val == "1"
        else:
            kw[key] = float(val)
    return L2Prefetch(**kw)


def part2(plans: list[str], batches: list[int], context: int, steps: int) -> list[dict]:
    from profile_decode_step import replay_ms, step_ms, sync

    from sparsegen.engine import LLMEngine, SamplingParams
    from sparsegen.models import random_model

    model = random_model("7b", device="cuda", dtype=torch.bfloat16, seed=0)
    rows = []
    for batch in batches:
        base_tokens = None
        for text in plans:
            model.set_l2_prefetch(parse_plan(text))
            cfg = model.config
            per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
            kv = int(batch * (context + 8 * steps + 256) * per_token * 1.1) + (512 << 20)
            engine = LLMEngine(model, kv_cache_bytes=kv, max_num_seqs=batch, max_num_batched_tokens=8192,
                               use_cuda_graphs=True)  # fmt: skip
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 256, (context,), generator=gen).tolist() for _ in range(batch)]
            seqs = engine.submit(prompts, SamplingParams(max_tokens=6 * steps + 16, ignore_eos=True))
            while any(s.t_first_token is None for s in seqs):
                engine.step()
            for _ in range(5):
                engine.step()
            sync()
            wall = min(step_ms(engine, steps) for _ in range(3))
            replay = replay_ms(engine)
            engine.step()
            sync()
            tokens = [list(s.output_ids[:12]) for s in seqs]
            same = base_tokens is None or tokens == base_tokens
            if base_tokens is None:
                base_tokens = tokens
            rows.append(
                {"batch": batch, "plan": text, "step_ms": wall, "replay_ms": replay, "same_tokens": same}
            )
            print(f"b{batch} plan {text:45s} step {wall:.3f} ms  replay {replay:.3f} ms  "
                  f"tokens {'same' if same else 'DIFFER'}", flush=True)  # fmt: skip
            del engine, seqs
            torch.cuda.empty_cache()
    model.set_l2_prefetch(None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="o,qkv,down", help="part 1: comma-separated of " + ",".join(LAYERS))
    ap.add_argument("--plans", default="off;o_at_attn=inf", help="part 2: ';'-separated plans ('' skips)")
    ap.add_argument("--batch", default="1", help="part 2: comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_l2_prefetch needs a CUDA GPU")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.layers:
        report["layers"] = part1(args.layers.split(","))
    if args.plans:
        report["plans"] = part2(args.plans.split(";"), [int(b) for b in args.batch.split(",")], args.context,
                                args.steps)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
