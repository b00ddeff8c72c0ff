"""Time the prefill kernel under other tile configs than the rule's pick (a tuning aid, GPU only).

    PYTHONPATH=. python benchmarks/tune_prefill.py [--seq 32768]

The main benchmark is `sparsegen bench`; this script only compares configs side by side, each
checked against the rule's output.
"""

from __future__ import annotations

import argparse
import json

import torch

import sparsegen
from sparsegen.bench.common import median_ms
from sparsegen.bench.prefill import inputs
from sparsegen.jit import triton_build
from sparsegen.kernels import prefill as prefill_mod
from sparsegen.testing import rel_err

VARIANTS = [
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    args = ap.parse_args()
    layer = sparsegen.get_pattern("phi3small").layers[0]
    q, k, v, cu = inputs(layer, args.seq)
    rule_kernel = prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16)
    base = rule_kernel(q, k, v, cu, cu)
    print(
        json.dumps(
            {"config": rule_kernel.config, "ms": median_ms(lambda: rule_kernel(q, k, v, cu, cu, check=False))}
        )
    )
    rule = triton_build.pick_config
    for config in VARIANTS:
        triton_build.pick_config = lambda *a, c=config: c
        prefill_mod.forget()
        try:
            kernel = prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16)
            err = rel_err(kernel(q, k, v, cu, cu), base)
            ms = median_ms(lambda k_=kernel: k_(q, k, v, cu, cu, check=False))
            print(json.dumps({"config": config, "ms": ms, "rel_err_vs_rule": err}))
        finally:
            triton_build.pick_config = rule
            prefill_mod.forget()


if __name__ == "__main__":
    main()
