"""The greedy token of a decode step: torch.argmax against `sampling.greedy_argmax` (GPU).

    PYTHONPATH=$PWD python3 benchmarks/engine/bench_argmax.py [--vocab 100352] [--rows 1,32]

float32 logits [rows, vocab] (Phi-3-Small's vocabulary by default), microseconds per call from
CUDA-graph replays of 20 calls, each over another copy of the logits; the two results are
checked equal.
"""

from __future__ import annotations

import argparse

import torch

from sparsegen.commands.bench.common import graph_us
from sparsegen.runner import sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=100352)
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--chunks", default="512,1024,2048,4096", help="ARGMAX_CHUNK values to time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_argmax needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, args.vocab, device="cuda", generator=gen) for _ in range(20)]
        plain = graph_us(lambda i, xs=xs: xs[i].argmax(dim=-1))
        times = []
        default = sampling.ARGMAX_CHUNK
        for chunk in (int(c) for c in args.chunks.split(",")):
            sampling.ARGMAX_CHUNK = chunk
            assert all(torch.equal(sampling.greedy_argmax(x), x.argmax(dim=-1)) for x in xs)
            times.append(f"chunk {chunk} {graph_us(lambda i, xs=xs: sampling.greedy_argmax(xs[i])):.2f}")
        sampling.ARGMAX_CHUNK = default
        print(
            f"rows {rows} vocab {args.vocab}: torch.argmax {plain:.2f} us; greedy_argmax " + ", ".join(times)
        )


if __name__ == "__main__":
    main()
