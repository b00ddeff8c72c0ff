"""Time prefill template variants and tile configs side by side (a tuning aid, GPU only).

    PYTHONPATH=. python benchmarks/prefill/tune_prefill.py [--out FILE] [--aot sm_90]

A variant is a template file in benchmarks/prefill/prefill_variants/ ("main" is templates/'s own) plus
an optional tile config (default: the rule's pick). Each variant's output is checked against
main's under the rule's config, in the same run. The main benchmark is `sparsegen bench`.
With --aot ARCH (no GPU needed) every variant is only compiled for ARCH, to catch build errors.

The template variants timed on 2026-11-30 (benchmarks/results/HISTORY.md: the session-1 template,
Triton warp specialization, hand-issued next-tile QK) lived in benchmarks/prefill_variants/ at
commit 8c87a6e; none was kept, so only tile configs of the main template are listed now.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

import sparsegen
from sparsegen.jit.render import templates_dir
from sparsegen.kernels import prefill as prefill_mod
from sparsegen.kernels import prefill_template

VARIANT_DIR = Path(__file__).resolve().parent / "prefill_variants"
RULE = None  # the rule's tile config
VARIANTS = [
    ("main", RULE),
    ("main", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128}),
    ("main", {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4}),
]
CASES = [("phi3small", 8192), ("phi3small", 32768), ("sliding-window", 32768)]


def _use(variant: str, config) -> None:
    """Point the prefill build at a variant's template and config (the cache key follows both)."""
    if variant == "main":
        prefill_template.TEMPLATE = "prefill_triton.py.jinja"
    else:
        target = templates_dir() / "_variants" / f"{variant}.py.jinja"
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(VARIANT_DIR / f"{variant}.py.jinja", target)
        prefill_template.TEMPLATE = f"_variants/{variant}.py.jinja"
    prefill_template.pick_config = _RULE_PICK if config is None else (lambda *a, c=config: dict(c))
    prefill_mod.forget()


_RULE_PICK = prefill_template.pick_config


def aot_only(arch: str) -> int:
    failures = 0
    for variant, config in VARIANTS:
        _use(variant, config)
        for pattern, _ in CASES[::2]:
            layer = sparsegen.get_pattern(pattern).layers[0]
            try:
                prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16, arch=arch)
                print(json.dumps({"variant": variant, "config": config, "pattern": pattern, "aot": "ok"}))
            except Exception as exc:  # noqa: BLE001 - report and go on to the next variant
                failures += 1
                print(json.dumps({"variant": variant, "pattern": pattern, "error": str(exc)[:300]}))
    return failures


def timed(out_path: Path | None) -> None:
    from sparsegen.commands.bench.common import median_ms
    from sparsegen.commands.bench.prefill import inputs, visible_pairs
    from sparsegen.testing import rel_err

    rows = []
    for pattern, seq in CASES:
        layer = sparsegen.get_pattern(pattern).layers[0]
        q, k, v, cu = inputs(layer, seq)
        flops = 4 * layer.head_dim * visible_pairs(layer, seq)
        _use("main", RULE)
        base = prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16)(q, k, v, cu, cu)
        for variant, config in VARIANTS:
            _use(variant, config)
            row = {"pattern": pattern, "seq": seq, "variant": variant, "config": config or "rule"}
            try:
                kernel = prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16)
                row["rel_err_vs_main"] = rel_err(kernel(q, k, v, cu, cu), base)
                row["ms"] = median_ms(lambda k_=kernel, a=(q, k, v, cu, cu): k_(*a, check=False))
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001 - a variant that fails to build is a result too
                row["error"] = str(exc)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if out_path is not None:
        out_path.write_text(json.dumps(rows, indent=1))
    print("\n== summary (ms, TFLOP/s useful, rel_err vs main)")
    for r in rows:
        name = f"{r['variant']} {r['config'] if r['config'] == 'rule' else tuple(r['config'].values())}"
        got = (
            f"{r['ms']:8.3f} {r['tflops']:6.1f} {r['rel_err_vs_main']:.1e}" if "ms" in r else r["error"][:80]
        )
        print(f"{r['pattern']:>15} {r['seq']:>6}  {name:<34} {got}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--aot", default=None, help="only compile every variant for this arch")
    args = ap.parse_args()
    try:
        if args.aot:
            sys.exit(1 if aot_only(args.aot) else 0)
        timed(args.out)
    finally:
        shutil.rmtree(templates_dir() / "_variants", ignore_errors=True)


if __name__ == "__main__":
    main()
