"""The attention features on an H200: the Gluon and tl prefill kernels on the gpt-oss, Gemma-2,
head_dim-256 and StreamingLLM layers, against SDPA, FlexAttention (Triton backend, and its FLASH
backend when `flash_attn.cute` imports) with the same score_mod / sinks, FA4 (when
`flash_attn.cute` imports) and the bf16 matmul ceiling, all in one process; plus each feature's
cost against the same layer without it, for each of our kernels.

    PYTHONPATH=$PWD python benchmarks/prefill/bench_features.py [--lens 8192,32768] [--cases a,b]
        [--variants gluon,tl] [--json OUT.json]

Cases (batch 1, bf16):
  gpt_oss         64 q / 8 KV heads, hd 64, window 128, learned sinks
  gemma2          16 q / 8 KV heads, hd 256, window 4096, soft-cap 50, scale 256**-0.5
  dense256        16 q / 8 KV heads, hd 256, dense causal
  dense256_cap50  the same with soft-cap 50 (FA4's soft-cap figure in issue 29)
  stream          32 q / 8 KV heads, hd 128, window 4096, 4 sink tokens
Each row times every variant (`gluon`, `tl`) on the case, and on the case "without" its feature
(soft-cap 0, no learned sinks, no sink tokens): "<variant> cost" = with / without, one kernel
against itself. Learned sinks in FlexAttention (no sink argument in torch 2.11): flex runs with
return_lse=True and the output is rescaled by sigmoid(lse - sink) (`sparsegen.flex.apply_learned_sinks`),
so its time includes that elementwise pass. SDPA takes the window as a boolean mask and has no
soft-cap or sinks: it is timed on the layer without them ("sdpa(no features)"). FA4 has no sink
tokens: it is not timed on `stream`. Useful FLOPs = 4 * D * visible pairs; "% ceiling" is against
the matmul rate measured here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

import sparsegen
from sparsegen import HeadSpec, LayerSpec, flex
from sparsegen.commands.bench.common import measure_ceilings, median_ms
from sparsegen.commands.bench.prefill import inputs, visible_pairs
from sparsegen.errors import SparsegenError
from sparsegen.kernels.prefill import get_prefill_kernel

_DENSE16 = (HeadSpec(dense=True),) * 16
CASES = {
    "gpt_oss": LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True),
    "gemma2": LayerSpec(
        16, 8, 256, (HeadSpec(block_size=64, sliding_window=4096),) * 16, logit_softcap=50.0, scale=256**-0.5
    ),  # fmt: skip
    "dense256": LayerSpec(16, 8, 256, _DENSE16),
    "dense256_cap50": LayerSpec(16, 8, 256, _DENSE16, logit_softcap=50.0),
    "stream": LayerSpec(32, 8, 128, (HeadSpec(block_size=64, sliding_window=4096, sink_tokens=4),) * 32),
}
VARIANTS = ("gluon", "tl")


def plain(layer: LayerSpec) -> LayerSpec:
    """The same layer without soft-cap, learned sinks or sink tokens."""
    heads = tuple(dataclasses.replace(h, sink_tokens=0) for h in layer.heads)
    return dataclasses.replace(layer, heads=heads, logit_softcap=0.0, learned_sinks=False)


def time_kernel(layer, variant, q, k, v, cu, sinks):
    """Median ms of our `variant` kernel (launch only: inputs validated once), or why not."""
    try:
        kernel = get_prefill_kernel(layer, dtype=torch.bfloat16, variant=variant)
    except SparsegenError as exc:  # a variant that does not cover the layer
        return f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
    kw = {} if sinks is None else {"sinks": sinks}
    scale = layer.default_scale
    return median_ms(lambda: kernel.launch(q, k, v, cu, cu, scale, **kw))


def time_flex(layer, q, k, v, sinks, n, backend=None):
    from torch.nn.attention.flex_attention import flex_attention

    if backend == "FLASH":
        try:
            import flash_attn.cute  # noqa: F401 - Flex's FLASH backend runs FA4's kernels
        except Exception as exc:  # noqa: BLE001 - optional: say why it is absent
            return f"n/a ({type(exc).__name__})"
    fa = torch.compile(flex_attention, dynamic=False)
    bm = flex.block_mask(layer, n, n, device="cuda", compile=True)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, n, D]
    mod = flex.score_mod(layer)
    opts = {"kernel_options": {"BACKEND": backend}} if backend else {}

    def run():
        out, lse = fa(qt, kt, vt, score_mod=mod, block_mask=bm, scale=layer.default_scale, enable_gqa=True,
                      return_lse=True, **opts)  # fmt: skip
        return out if sinks is None else flex.apply_learned_sinks(out, lse, sinks)

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - a backend that refuses this score_mod / mask
        return f"n/a ({type(exc).__name__}: {str(exc)[:60]})"
    return median_ms(run)


def time_sdpa(layer, q, k, v, n):
    import torch.nn.functional as F

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if all(h.dense for h in layer.heads):
        return median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
    if n > 8192:  # SDPA's masked path materialises [H, n, n] scores: 256 GiB at 32K
        return "n/a (masked SDPA above 8K)"
    one = LayerSpec(1, 1, layer.head_dim, layer.heads[:1])  # every head of these cases alike
    mask = sparsegen.visible_mask(one, n, n).cuda()  # [1, n, n] bool, broadcast over heads
    return median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True))


def time_fa4(layer, q, k, v, sinks):
    if any(h.sink_tokens for h in layer.heads):
        return "n/a (FA4 has no sink tokens)"
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - FA4 is optional: say why it is absent
        return f"n/a ({type(exc).__name__})"
    w = layer.heads[0].sliding_window
    kw = {"causal": True, "softmax_scale": layer.default_scale}
    if w:
        kw["window_size"] = (w - 1, 0)
    if layer.logit_softcap:
        kw["softcap"] = layer.logit_softcap
    if sinks is not None:
        kw["learnable_sink"] = sinks
    qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))  # [1, n, H, D]
    try:
        flash_attn_func(qb, kb, vb, **kw)
        return median_ms(lambda: flash_attn_func(qb, kb, vb, **kw))
    except Exception as exc:  # noqa: BLE001 - an FA4 build without one of these arguments
        return f"n/a ({type(exc).__name__}: {str(exc)[:60]})"


def bench_row(name, layer, n, variants, ceil) -> dict:
    q, k, v, cu = inputs(layer, n)
    sinks = torch.randn(layer.num_heads, device="cuda") if layer.learned_sinks else None
    flops = 4 * layer.head_dim * visible_pairs(layer, n)
    row: dict = {"case": name, "seq_len": n}
    for variant in variants:
        row[variant] = time_kernel(layer, variant, q, k, v, cu, sinks)
        if layer.features:
            row[f"{variant}(no features)"] = without = time_kernel(plain(layer), variant, q, k, v, cu, None)
            if isinstance(row[variant], float) and isinstance(without, float):
                row[f"{variant} cost"] = row[variant] / without
    row["flex"] = time_flex(layer, q, k, v, sinks, n)
    row["flex FLASH"] = time_flex(layer, q, k, v, sinks, n, backend="FLASH")
    row["sdpa(no features)"] = time_sdpa(plain(layer), q, k, v, n)
    row["fa4"] = time_fa4(layer, q, k, v, sinks)
    for variant in variants:
        if not isinstance(row[variant], float):
            continue
        row[f"% ceiling ({variant})"] = 100 * flops / (row[variant] * 1e-3) / 1e12 / ceil.matmul_tflop_s
        for other in ("flex", "flex FLASH", "sdpa(no features)", "fa4"):
            if isinstance(row[other], float):
                row[f"{other} / {variant}"] = row[other] / row[variant]  # > 1: ours is faster
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="8192,32768")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    variants = tuple(args.variants.split(","))
    if set(variants) - set(VARIANTS):
        ap.error(f"variants are {VARIANTS}, got {variants}")
    ceil = measure_ceilings()
    rows = []
    for name in names:
        for n in (int(x) for x in args.lens.split(",")):
            rows.append(bench_row(name, CASES[name], n, variants, ceil))
            print(json.dumps(rows[-1]), flush=True)
    print(f"matmul ceiling {ceil.matmul_tflop_s:.0f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling_tflop_s": ceil.matmul_tflop_s, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
