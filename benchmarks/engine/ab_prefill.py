"""A/B of session 7's storage switches on the time to first token, alternating in one process (GPU).

    PYTHONPATH=$PWD python3 benchmarks/engine/ab_prefill.py [--lengths 8192,32768] [--rounds 2]
        [--chunks 8192,32768] [--json OUT]

Modes, each in an engine of its own (random 7b weights, bf16, no decode graphs), once per prefill
chunk size of `--chunks` (`max_num_batched_tokens`; default 8K, as the earlier A/Bs ran; the
engine's default is 32K since session 12):
- `token`: token-major KV pages and every weight [out, in] (the engines of session 6);
- `head`: head-major KV pages (`EngineConfig.kv_layout`);
- `head+in_major`: and down_proj / lm_head stored [in, out] (`layers.Linear`): session 7's defaults;
- `whole_last`: `head+in_major` with the last layer run on every row (the prefill batch's
  `sampled_*` tables dropped), as before session 11;
- `default`: what an engine does today (`head+in_major`, the last layer's attention, O
  projection and MLP on the sampled rows only).
Per length: a warm-up prompt of that length, then the median TTFT of `--prompts` more (as
`bench_generate.py` measures it: `ttft_s` of a one-token generate).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch
from ab_decode_step import ab_models

from sparsegen.engine import LLMEngine, SamplingParams

MODES = {  # name: (kv_layout, in_major, last layer on the sampled rows only)
    "token": ("token", False, False),
    "head": ("head", False, False),
    "head+in_major": ("head", True, False),
    "whole_last": ("head", True, False),
    "default": ("head", True, True),
}


def whole_last_layer(runner) -> None:
    """Make `runner` build prefill batches without the sampled_* tables (the model then runs its
    last layer on every row)."""
    prepare = runner.prepare_prefill

    def without_tables(chunks):
        ids, batch = prepare(chunks)
        return ids, replace(batch, sampled_block_tables=None, sampled_seq_lens=None)

    runner.prepare_prefill = without_tables


def ttft_ms(
    model, kv_layout: str, length: int, prompts: int, pruned: bool = True, chunk: int = 8192
) -> float:
    engine = LLMEngine(model, kv_cache_bytes=6 << 30, max_num_seqs=1, max_num_batched_tokens=chunk,
                       use_cuda_graphs=False, kv_layout=kv_layout)  # fmt: skip
    if not pruned:
        whole_last_layer(engine.runner)
    gen = torch.Generator().manual_seed(length)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for i in range(prompts + 1):  # the first is the warm-up
        prompt = torch.randint(0, 256, (length,), generator=gen).tolist()
        res = engine.generate([prompt], one)[0]
        if i:
            times.append(res.metrics.ttft_s * 1e3)
    del engine
    torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--chunks", default="8192", help="comma-separated prefill chunk sizes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    models = ab_models("ab_prefill", any(not MODES[m][1] for m in modes))
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        for rnd in range(args.rounds):
            for mode in modes:
                for chunk in (int(c) for c in args.chunks.split(",")):
                    layout, in_major, pruned = MODES[mode]
                    ms = ttft_ms(models[in_major], layout, length, args.prompts, pruned, chunk)
                    rows.append({"length": length, "round": rnd, "mode": mode, "chunk": chunk, "ttft_ms": ms})
                    print(
                        f"{length:>6} round {rnd} {mode:14s} chunk {chunk:>6} TTFT {ms:7.1f} ms"
                        f" (median of {args.prompts})",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
