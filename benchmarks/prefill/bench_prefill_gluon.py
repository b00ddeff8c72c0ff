"""The Gluon (sm_90) prefill kernel on an H200: a correctness sweep, then timings in one process.

    PYTHONPATH=$PWD python benchmarks/prefill/bench_prefill_gluon.py [--check N] [--cases dense,phi3small,window]
        [--lens 8192,32768,131072] [--json OUT.json]
    (head_dim 96: --cases dense_hd96,phi3small_hd96,window_hd96 --check 0)
    (narrow windows: --narrow times the tl kernel on gpt-oss's window-128 layer, packed and not, at
    --variant-lens, beside FA4 and FlexAttention)

Correctness: N fuzzed specs (the first two are phi3small's sparse and dense layers) x a few
varlen shapes (odd lengths, prefixes) x bf16/fp16, NaN-poisoned outputs, each compared with the
float32 reference and with the tl kernel. Timings (batch 1, bf16, 32/8 heads, D = 128, or 96 for the
*_hd96 cases: the same layers at head_dim 96, which the Gluon kernel runs in 128-wide tiles): the Gluon
kernel and the tl kernel (both without the host check), dense causal SDPA for dense cases, and the
bf16 matmul ceiling measured in the same process; useful FLOPs = 4 * D * visible pairs (D = 96 for
the *_hd96 cases, whose 128-wide tiles do 4/3 of that work: 75 % of the ceiling is their limit).
FA4 and FlexAttention's FLASH backend (the `bench` extra, `flash_attn.cute`) are timed beside them
on the same inputs unless --no-peers; where they cannot run their columns say "n/a (why)".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import sys
import time

import torch

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.commands.bench import peers
from sparsegen.commands.bench.cases import is_time
from sparsegen.commands.bench.common import measure_ceilings, median_ms
from sparsegen.commands.bench.prefill import inputs, visible_pairs
from sparsegen.kernels import prefill_gluon_template as tpl
from sparsegen.kernels.prefill import get_prefill_kernel
from sparsegen.kernels.prefill_gluon import get_gluon_prefill_kernel
from sparsegen.testing import PrefillProblem, rel_err, sample_layer_spec

CASES = {
    "dense": lambda: sparsegen.get_pattern("phi3small").layers[1],
    "phi3small": lambda: sparsegen.get_pattern("phi3small").layers[0],
    "window": lambda: sparsegen.get_pattern("sliding-window").layers[0],
}
CASES.update(
    {
        f"{name}_hd96": (lambda make=make: dataclasses.replace(make(), head_dim=96))
        for name, make in list(CASES.items())
    }
)
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
CHECK_VARIANTS = (
    {},
    {"persistent": False},
    {"persistent": True, "programs": 3},
)  # the correctness sweep alternates these configs


def check_specs(n: int) -> list:
    rng = random.Random(4321)
    specs = [CASES["phi3small"](), CASES["dense"](), CASES["window"]()]
    while len(specs) < n:
        layer = sample_layer_spec(
            rng,
            hybrid=bool(len(specs) % 2),
            head_dims=(64, 128),
            ratios=(1, 2, 4, 8),
            windows=(1, 17, 100, 333, 5000),
        )
        if tpl.covers(layer, "bf16") is None:
            specs.append(layer)
    return specs[:n]


def correctness(n_specs: int) -> list[dict]:
    rows = []
    for sid, layer in enumerate(check_specs(n_specs)):
        rng = random.Random(sid)
        for dtype in (torch.bfloat16, torch.float16):
            t = get_prefill_kernel(layer, dtype=dtype, variant="tl")
            for case in range(8):
                g = get_gluon_prefill_kernel(layer, dtype=dtype, **CHECK_VARIANTS[case % len(CHECK_VARIANTS)])
                batch = rng.randint(1, 3)
                k_lens = [
                    rng.choice([1, 63, 64, 65, 129, 777, 1000, 2049, rng.randint(1, 3000)])
                    for _ in range(batch)
                ]
                q_lens = [n if rng.random() < 0.5 else rng.randint(1, n) for n in k_lens]
                p = PrefillProblem(
                    layer,
                    q_lens,
                    k_lens,
                    seed=case,
                    dtype=dtype,
                    device="cuda",
                    scale=rng.choice([None, 0.05]),
                )
                ref = p.reference(exact=False)  # float32 on the GPU
                out = g(*p.args())
                tl_out = t(*p.args())
                err, err_tl = rel_err(out, ref), rel_err(out, tl_out)
                ok = err < TOL[dtype] and err_tl < 2e-2
                rows.append(
                    {
                        "spec": sid,
                        "dtype": str(dtype),
                        "q_lens": q_lens,
                        "k_lens": k_lens,
                        "persistent": g.config["persistent"],
                        "rel_err": err,
                        "rel_err_vs_tl": err_tl,
                        "ok": ok,
                    }
                )
                if not ok:
                    print(
                        f"FAIL spec {sid} {dtype} q {q_lens} k {k_lens}: err {err:.3g} vs tl {err_tl:.3g}"
                        f" kinds {layer.kinds() if hasattr(layer, 'kinds') else ''}",
                        flush=True,
                    )
    return rows


def timing(case: str, seq_len: int, matmul: float, sdpa: bool, peers_on: bool = True) -> dict:
    layer = CASES[case]()
    q, k, v, cu = inputs(layer, seq_len)
    g = get_gluon_prefill_kernel(layer, dtype=torch.bfloat16)
    t = get_prefill_kernel(layer, dtype=torch.bfloat16, variant="tl")
    out_g, out_t = g(q, k, v, cu, cu), t(q, k, v, cu, cu)
    row = {"case": case, "seq_len": seq_len, "rel_err_gluon_vs_tl": rel_err(out_g, out_t)}
    row["gluon_ms"] = median_ms(lambda: g(q, k, v, cu, cu, check=False))
    row["tl_ms"] = median_ms(lambda: t(q, k, v, cu, cu, check=False))
    row["gluon_api_ms"] = median_ms(lambda: g(q, k, v, cu, cu))
    flops = 4 * layer.head_dim * visible_pairs(layer, seq_len)
    row["useful_tflops_gluon"] = flops / (row["gluon_ms"] * 1e-3) / 1e12
    row["useful_tflops_tl"] = flops / (row["tl_ms"] * 1e-3) / 1e12
    row["gluon_of_ceiling"] = row["useful_tflops_gluon"] / matmul
    row["tl_of_ceiling"] = row["useful_tflops_tl"] / matmul
    if sdpa:
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        f = torch.nn.functional.scaled_dot_product_attention
        row["sdpa_ms"] = median_ms(lambda: f(qt, kt, vt, is_causal=True, enable_gqa=True))
        row["gluon_x_sdpa"] = row["sdpa_ms"] / row["gluon_ms"]  # > 1: Gluon is faster
        row["tl_x_sdpa"] = row["sdpa_ms"] / row["tl_ms"]
    if peers_on:  # FA4 and FlexAttention's FLASH backend: "n/a (why)" where they cannot run
        row["fa4_ms"] = peers.time_fa4(layer, q, k, v)[0]
        row["flex_flash_ms"] = peers.time_flex(layer, q, k, v, backend="FLASH")[0]
        for name in ("fa4", "flex_flash"):
            if is_time(row[f"{name}_ms"]):
                row[f"gluon_x_{name}"] = row[f"{name}_ms"] / row["gluon_ms"]  # > 1: Gluon is faster
                row[f"{name}_of_ceiling"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12 / matmul
    torch.cuda.empty_cache()
    return row


BASE = {"block_n": 64, "stages": 3, "q_smem": False, "persistent": False, "consumers": 2, "vpair": False}
VARIANTS = {  # {} is the rule's choice for the case (prefill_gluon_template.config)
    "rule": {},
    "rule_pingpong": {"pingpong": True},
    "c2_n64_s3": BASE,
    "c2_n64_s3_persist": {**BASE, "persistent": True},
    "c1_n64_s3": {**BASE, "consumers": 1},
    "c2_n64_s3_qsmem": {**BASE, "q_smem": True},
    "c2_n64_s2": {**BASE, "stages": 2},
    "c2_n128_s2": {**BASE, "block_n": 128, "stages": 2},
    "c2_n128_s2_qsmem": {**BASE, "block_n": 128, "stages": 2, "q_smem": True},
    "c2_n128_s2_qsmem_persist": {**BASE, "block_n": 128, "stages": 2, "q_smem": True, "persistent": True},
    "c2_n64_s4": {**BASE, "stages": 4},
    "c2_n64_s4_persist": {**BASE, "stages": 4, "persistent": True},
    "c2_n64_s2_persist": {**BASE, "stages": 2, "persistent": True},
    "c2_n128_s3": {**BASE, "block_n": 128, "stages": 3},
    "c2_n128_s3_kv": {**BASE, "block_n": 128, "stages": 3, "kv_major": True},
    "c2_n128_s3_kv_persist": {**BASE, "block_n": 128, "stages": 3, "kv_major": True, "persistent": True},
    "c2_n64_s3_kv": {**BASE, "kv_major": True},
    "c2_n64_s3_kv_persist": {**BASE, "kv_major": True, "persistent": True},
    "rule_kv": {"kv_major": True},
    "c2_n64_s4_kv": {**BASE, "stages": 4, "kv_major": True},
    "c2_n64_s2_kv": {**BASE, "stages": 2, "kv_major": True},
    "rule_tile_order": {"kv_major": False},
    "c2_n128_s2_vpair_kv": {**BASE, "block_n": 128, "stages": 2, "vpair": True, "kv_major": True},
    "c2_n128_s3_vpair_kv": {**BASE, "block_n": 128, "stages": 3, "vpair": True, "kv_major": True},
}


NARROW_CASES = {  # gpt-oss's window layer, and the same window without GQA
    "gpt_oss": LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True),
    "w128_mha": LayerSpec(
        16, 16, 64, (HeadSpec(block_size=64, sliding_window=128),) * 16, learned_sinks=True
    ),
}


def narrow(lens: list[int], matmul: float) -> list[dict]:
    """The tl kernel on narrow windows with the rule's config (packed GQA heads, 32-key tiles:
    prefill_template.narrow_config) and with the rule turned off (today's 128 x 64 tiles, one
    head per program), beside FA4 and FlexAttention (Triton, FLASH), on the same inputs."""
    from sparsegen.kernels import prefill as prefill_mod
    from sparsegen.kernels import prefill_template

    rows = []
    for case, layer in NARROW_CASES.items():
        rule = get_prefill_kernel(layer, dtype=torch.bfloat16, variant="tl")
        keep = prefill_template.narrow_config
        prefill_template.narrow_config = lambda layer, config, arch: config
        prefill_mod.forget()
        try:
            wide = get_prefill_kernel(layer, dtype=torch.bfloat16, variant="tl")
        finally:
            prefill_template.narrow_config = keep
            prefill_mod.forget()
        for n in lens:
            q, k, v, cu = inputs(layer, n)
            sinks = torch.randn(layer.num_heads, device="cuda")  # [H] fp32
            out = rule(q, k, v, cu, cu, sinks=sinks)
            row = {"case": case, "seq_len": n, "config": rule.config}
            row["rel_err_narrow_vs_wide"] = rel_err(out, wide(q, k, v, cu, cu, sinks=sinks))
            for name, kernel in (("narrow", rule), ("wide", wide)):
                row[f"{name}_ms"] = median_ms(
                    functools.partial(kernel, q, k, v, cu, cu, check=False, sinks=sinks)
                )
            row["fa4_ms"] = peers.time_fa4(layer, q, k, v, sinks)[0]
            row["flex_ms"] = peers.time_flex(layer, q, k, v, sinks)[0]
            row["flex_flash_ms"] = peers.time_flex(layer, q, k, v, sinks, backend="FLASH")[0]
            flops = 4 * layer.head_dim * visible_pairs(layer, n)
            for name in ("narrow", "wide", "fa4", "flex", "flex_flash"):
                if is_time(row[f"{name}_ms"]):
                    row[f"{name}_of_ceiling"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12 / matmul
                    row[f"narrow_x_{name}"] = row[f"{name}_ms"] / row["narrow_ms"]  # > 1: narrow is faster
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
            torch.cuda.empty_cache()
    return rows


def _sm_clock_mhz() -> float:
    """The SM clock now (NVML), or NaN where NVML is not readable: the card is measured as found,
    and a clock that sagged under load explains a slow round."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - no NVML here
        return float("nan")


def _runs(layer, n: int, kernels: dict) -> dict:
    """One timed callable per kernel on the same inputs, plus dense SDPA for a dense layer."""
    q, k, v, cu = inputs(layer, n)
    runs = {name: functools.partial(g, q, k, v, cu, cu, check=False) for name, g in kernels.items()}
    if layer.is_dense:
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        runs["sdpa"] = functools.partial(sdpa, qt, kt, vt, is_causal=True, enable_gqa=True)
    return runs


def variants(names: list[str], cases: list[str], lens: list[int], rounds: int = 3) -> list[dict]:
    """Time tile/partition variants side by side: every variant is built and checked against the
    reference first, then each round times every variant of a (case, length) in a rotated order,
    dense SDPA among them for dense cases, so drift (clocks, heat) hits every variant alike. A
    row's `ms` is the median over rounds, `spread` (max - min) / median."""
    import statistics

    rows = []
    for case in cases:
        layer = CASES[case]()
        kernels = {}
        for name in names:
            ov = VARIANTS[name]
            vertical = any(h.vert_stride and not h.dense for h in layer.heads)
            if vertical and ov.get("block_n", 128) > 64 and not ov.get("vpair", True):
                continue  # 128-key tiles need vpair on 64-token vertical blocks
            g = get_gluon_prefill_kernel(layer, dtype=torch.bfloat16, **ov)
            p = PrefillProblem(layer, [700, 1500], [1000, 2049], seed=3, dtype=torch.bfloat16, device="cuda")
            kernels[name] = (g, rel_err(g(*p.args()), p.reference(exact=False)))
        for n in lens:
            runs = _runs(layer, n, {name: g for name, (g, _) in kernels.items()})
            times: dict[str, list[float]] = {name: [] for name in runs}
            clocks = []
            order = list(runs)
            for r in range(rounds):
                for name in order[r % len(order) :] + order[: r % len(order)]:
                    times[name].append(median_ms(runs[name]))
                    clocks.append(_sm_clock_mhz())
            flops = 4 * layer.head_dim * visible_pairs(layer, n)
            sdpa_ms = statistics.median(times["sdpa"]) if "sdpa" in times else None
            for name, ts in times.items():
                ms = statistics.median(ts)
                row = {"case": case, "variant": name, "seq_len": n, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                       "spread": (max(ts) - min(ts)) / ms, "rounds": ts,
                       "rel_err": kernels[name][1] if name in kernels else None}  # fmt: skip
                if sdpa_ms:
                    row["x_sdpa"] = sdpa_ms / ms
                rows.append(row)
                xs = f" x_sdpa {row['x_sdpa']:.3f}" if sdpa_ms else ""
                err = f" err {row['rel_err']:.2g}" if row["rel_err"] is not None else ""
                print(
                    f"variant {name:24s} {case:9s} {n:6d}: {ms:.3f} ms {row['tflops']:.0f} TFLOP/s "
                    f"spread {row['spread']:.1%}{xs}{err}",
                    flush=True,
                )
            print(f"  SM clock over these rounds: {min(clocks):.0f}-{max(clocks):.0f} MHz", flush=True)
            del runs
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", type=int, default=6, help="fuzzed specs in the correctness sweep (0: none)")
    ap.add_argument("--cases", default="dense,phi3small,window")
    ap.add_argument("--lens", default="8192,32768,131072")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="", help="comma list of VARIANTS to time first ('all')")
    ap.add_argument("--variant-cases", default="dense,phi3small")
    ap.add_argument("--variant-lens", default="8192,32768")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant timing")
    ap.add_argument("--no-peers", action="store_true", help="skip FA4 and FlexAttention's FLASH backend")
    ap.add_argument("--narrow", action="store_true", help="time the tl kernel's narrow-window rule first")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    report: dict = {}
    t0 = time.perf_counter()
    for case in [c for c in args.cases.split(",") if c]:  # cold builds, timed
        for dt in (torch.bfloat16, torch.float16):
            s = time.perf_counter()
            get_gluon_prefill_kernel(CASES[case](), dtype=dt)
            report.setdefault("build_s", {})[f"{case}_{dt}"] = time.perf_counter() - s
    if args.variants:
        names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
        report["variants"] = variants(
            names, args.variant_cases.split(","), [int(x) for x in args.variant_lens.split(",")], args.rounds
        )
    if args.check:
        rows = correctness(args.check)
        report["correctness"] = rows
        worst = max(r["rel_err"] for r in rows)
        print(
            f"correctness: {sum(r['ok'] for r in rows)}/{len(rows)} ok, worst rel err {worst:.3g}, "
            f"worst vs tl {max(r['rel_err_vs_tl'] for r in rows):.3g} ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    ceil = measure_ceilings()
    report["ceilings"] = ceil.to_dict()
    if args.narrow:
        report["narrow"] = narrow([int(x) for x in args.variant_lens.split(",")], ceil.matmul_tflop_s)
    print(f"ceilings: matmul {ceil.matmul_tflop_s:.0f} TFLOP/s, copy {ceil.copy_tb_s:.2f} TB/s", flush=True)
    report["timings"] = []
    for case in [c for c in args.cases.split(",") if c]:
        for n in (int(x) for x in args.lens.split(",")):
            row = timing(
                case, n, ceil.matmul_tflop_s, sdpa=CASES[case]().is_dense, peers_on=not args.no_peers
            )
            report["timings"].append(row)
            extra = (
                f" sdpa {row['sdpa_ms']:.3f} ms (gluon x{row['gluon_x_sdpa']:.2f}, tl x{row['tl_x_sdpa']:.2f})"
                if "sdpa_ms" in row
                else ""
            )
            for name in ("fa4", "flex_flash"):
                got = row.get(f"{name}_ms")
                if is_time(got):
                    extra += f" | {name} {got:.3f} ms ({row[f'{name}_of_ceiling']:.0%}, gluon x{row[f'gluon_x_{name}']:.2f})"
                elif got is not None:
                    extra += f" | {name} {got}"
            print(
                f"{case:14s} {n:6d}: gluon {row['gluon_ms']:.3f} ms ({row['gluon_of_ceiling']:.0%}) api "
                f"{row['gluon_api_ms']:.3f} | tl {row['tl_ms']:.3f} ms ({row['tl_of_ceiling']:.0%}){extra} "
                f"err vs tl {row['rel_err_gluon_vs_tl']:.2g}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    bad = [r for r in report.get("correctness", []) if not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
