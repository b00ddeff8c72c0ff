"""The model's fused elementwise kernels (sparsegen/kernels/fused/) on the 7b shapes, against
their read/write floor at the copy rate and, with --base, against another tree's fused.py loaded
in the same process (the previous commit's kernels, timed in alternating order).

    PYTHONPATH=$PWD python3 benchmarks/fused/bench_fused.py --base .gpu/base/sparsegen/models/fused.py --json out.json

Rows: GeGeLU [T, 2 x 14336] -> [T, 14336]; rotary + split + KV-cache write of qkv [T, 8, 6, 128];
residual add + LayerNorm [T, 4096]; for T = 1 and 32 (decode) and 8192 (a prefill chunk).
Decode sizes are timed in CUDA graphs (`graph_us`), so launch gaps are left out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from types import SimpleNamespace

import torch

from sparsegen.commands.bench.common import graph_us, measure_ceilings
from sparsegen.kernels.fused import add_norm, gegelu, rotary

HIDDEN, FF, HKV, G, D = 4096, 14336, 8, 4, 128
# this tree's fused kernels by the names of a base tree's models/fused.py (see load_module)
fused = SimpleNamespace(
    gegelu=gegelu.gegelu, rotary_qkv=rotary.rotary_qkv, add_layer_norm=add_norm.add_layer_norm
)


def load_module(path: str):
    """A fused.py from another tree, as a module of its own (its kernels are compiled apart)."""
    spec = importlib.util.spec_from_file_location("sparsegen.models._fused_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def cases(t: int, dev, dtype):
    """(name, bytes moved, fn(mod)) per kernel at T = t."""
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, 2 * FF, device=dev, dtype=dtype, generator=g)  # [T, 2F]
    qkv = torch.randn(t, HKV, G + 2, D, device=dev, dtype=dtype, generator=g)  # [T, Hkv, G + 2, D]
    angles = torch.rand(t, D // 2, device=dev, generator=g) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # [T, D]
    pages = -(-t // 16) + 1
    cache = tuple(torch.zeros(pages, 16, HKV, D, device=dev, dtype=dtype) for _ in range(2))
    slots = torch.randperm(pages * 16, device=dev)[:t]
    h = torch.randn(t, HIDDEN, device=dev, dtype=dtype, generator=g)  # [T, hidden]
    res = torch.randn(t, HIDDEN, device=dev, dtype=dtype, generator=g)
    w = torch.randn(HIDDEN, device=dev, dtype=dtype, generator=g)
    b = torch.randn(HIDDEN, device=dev, dtype=dtype, generator=g)
    e = x.element_size()
    return [
        ("gegelu", 3 * t * FF * e, lambda m: m.gegelu(x, 20.0)),
        # reads qkv and cos/sin (fp32), writes q, k, v and k, v into the cache
        (
            "rotary_qkv",
            t * (HKV * (G + 2) * D * e * 2 + 2 * HKV * D * e + 2 * D * 4),
            lambda m: m.rotary_qkv(qkv, cos, sin, cache, slots),
        ),  # fmt: skip
        ("add_layer_norm", 4 * t * HIDDEN * e, lambda m: m.add_layer_norm(h, res, w, b, 1e-5)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="another tree's sparsegen/models/fused.py to compare with")
    ap.add_argument("--tokens", default="1,32,8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused needs a CUDA GPU")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    mods = {"new": fused}
    if args.base:
        mods["base"] = load_module(args.base)
    bw = measure_ceilings().copy_tb_s * 1e12
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        for name, nbytes, fn in cases(t, dev, dtype):
            times = {k: [] for k in mods}
            for r in range(3):  # alternating order, median of rounds
                for k in sorted(mods, reverse=r % 2 == 1):
                    times[k].append(graph_us(lambda i, m=mods[k], f=fn: f(m), calls=20))
            med = {k: sorted(v)[1] for k, v in times.items()}
            row = {
                "kernel": name,
                "tokens": t,
                "floor_us": nbytes / bw * 1e6,
                **{f"{k}_us": v for k, v in med.items()},
            }
            if "base" in med:
                row["new_over_base"] = med["new"] / med["base"]
            rows.append(row)
            extra = (
                f"  base {med['base']:8.1f} us  new/base {row['new_over_base']:.3f}" if "base" in med else ""
            )
            print(
                f"{name:15s} T {t:5d}: new {med['new']:8.1f} us  floor {row['floor_us']:7.1f} us{extra}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tb_s": bw / 1e12, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
