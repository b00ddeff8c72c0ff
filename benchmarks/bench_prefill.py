"""Prefill benchmark: sparsegen vs dense causal SDPA vs FlexAttention, with the ceilings.

    PYTHONPATH=. python benchmarks/bench_prefill.py --out prefill.json [--seqs 8192,32768] [--long]

Batch 1, bf16, 32 query heads, 8 KV heads, head_dim 128: the Phi-3-Small sparse layer at each
length and a sliding window of 4096 at 32K. All numbers come from this one process: medians of
triton.testing.do_bench, the bf16 matmul ceiling measured first, and the useful-FLOP floor
(4 * D * visible pairs at that ceiling). sparsegen's output is checked against FlexAttention.
"""

from __future__ import annotations

import argparse
import json

import torch

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.bench.common import flex_mask_mod, format_table, measure_ceilings, median_ms
from sparsegen.bench.prefill import visible_pairs
from sparsegen.testing import rel_err


def _inputs(layer: LayerSpec, seq: int):
    gen = torch.Generator(device="cuda").manual_seed(seq)
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.randn(seq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # q: [S, H, D]
    k = torch.randn(seq, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # k: [S, Hkv, D]
    v = torch.randn(seq, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def bench(name: str, layer: LayerSpec, seq: int, matmul_tflop_s: float, flex: bool) -> dict:
    q, k, v, cu = _inputs(layer, seq)
    kernel = sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16)
    out = kernel(q, k, v, cu, cu)
    row = {"case": name, "seq_len": seq}
    row["sparsegen_ms"] = median_ms(lambda: kernel(q, k, v, cu, cu, check=False))
    row["sparsegen_api_ms"] = median_ms(lambda: sparsegen.prefill(q, k, v, cu, cu, layer))
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H|Hkv, S, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_dense_ms"] = median_ms(lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True))
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        try:
            mod = flex_mask_mod(layer, seq, seq, "cuda")
            mask = create_block_mask(mod, None, layer.num_heads, seq, seq, device="cuda", _compile=True)
            fn = torch.compile(flex_attention)
            ref = fn(qt, kt, vt, block_mask=mask, enable_gqa=True)
            row["rel_err_vs_flex"] = rel_err(out, ref[0].transpose(0, 1))
            row["flex_ms"] = median_ms(lambda: fn(qt, kt, vt, block_mask=mask, enable_gqa=True))
        except Exception as exc:  # noqa: BLE001 - the other columns still count
            row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    pairs = visible_pairs(layer, seq)
    row["floor_ms"] = 4 * layer.head_dim * pairs / (matmul_tflop_s * 1e12) * 1e3
    row["useful_tflop_s"] = 4 * layer.head_dim * pairs / (row["sparsegen_ms"] * 1e-3) / 1e12
    row["speedup_vs_sdpa"] = row["sdpa_dense_ms"] / row["sparsegen_ms"]
    if "flex_ms" in row:
        row["speedup_vs_flex"] = row["flex_ms"] / row["sparsegen_ms"]
    print(json.dumps(row), flush=True)
    return row


VARIANTS = [
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
]


def variants(layer: LayerSpec, seq: int) -> list[dict]:
    """sparsegen alone under other tile configs (the rule's pick is the main row)."""
    from sparsegen.jit import triton_build
    from sparsegen.kernels import prefill as prefill_mod

    q, k, v, cu = _inputs(layer, seq)
    base = prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16)(q, k, v, cu, cu)
    rule, rows = triton_build.pick_config, []
    for config in VARIANTS:
        triton_build.pick_config = lambda *a, c=config: c
        prefill_mod.forget()
        row = {"case": f"phi3small {config}", "seq_len": seq}
        try:
            kernel = prefill_mod.get_prefill_kernel(layer, dtype=torch.bfloat16)
            row["rel_err_vs_rule"] = rel_err(kernel(q, k, v, cu, cu), base)
            row["sparsegen_ms"] = median_ms(lambda k_=kernel: k_(q, k, v, cu, cu, check=False))
        except Exception as exc:  # noqa: BLE001 - one failing variant does not end the run
            row["error"] = str(exc)[:200]
        finally:
            triton_build.pick_config = rule
            prefill_mod.forget()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--seqs", default="8192,32768", help="Phi-3-Small sequence lengths")
    ap.add_argument("--long", action="store_true", help="add 131072 tokens (no FlexAttention there)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time other tile configs at 32K")
    args = ap.parse_args()
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings.copy_tb_s:.2f} TB/s, bf16 matmul {ceilings.matmul_tflop_s:.0f} TFLOP/s")
    phi3 = sparsegen.get_pattern("phi3small").layers[0]
    window = LayerSpec(32, 8, 128, (HeadSpec(sliding_window=4096),) * 32)
    cases = [("phi3small", phi3, int(s), not args.no_flex) for s in args.seqs.split(",")]
    cases.append(("window4096", window, 32768, not args.no_flex))
    if args.long:
        cases.append(("phi3small", phi3, 131072, False))
    rows = [bench(name, layer, seq, ceilings.matmul_tflop_s, flex) for name, layer, seq, flex in cases]
    if args.variants:
        rows += variants(phi3, 32768)
    cols = ["case", "seq_len", "sparsegen_ms", "sparsegen_api_ms", "sdpa_dense_ms", "flex_ms", "floor_ms",
            "speedup_vs_sdpa", "speedup_vs_flex", "useful_tflop_s", "rel_err_vs_flex"]  # fmt: skip
    print(format_table(cols, [[r.get(c, "-") for c in cols] for r in rows]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceilings": ceilings.to_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
