"""A/B of the engine's decode-step switches, alternating in one process (GPU).

    PYTHONPATH=$PWD python3 benchmarks/engine/ab_decode_step.py [--batch 1,32] [--rounds 2] [--json OUT]

Modes, each in an engine of its own (CUDA graphs captured under the mode), Phi-3-Small 7b random
weights, bf16, 8K prompts:
- `base`: SPARSEGEN_NO_PDL=1 and `ModelOptions.gemv_o_proj` off (every linear on cuBLAS);
- `pdl`: add + LayerNorm launched with programmatic dependent launch (`kernels.fused.add_norm.use_pdl`:
  batch 1 only: session 6's call 4 measured it slower at 32, before the row limit);
- `pdl+gemv_o`: and the batch-1 output projection through the Triton GEMV (session 6's defaults);
- `head_kv`: and head-major KV pages (`EngineConfig.kv_layout="head"`; the modes above use
  token-major pages, as every engine did before session 7);
- `in_major_w`: and down_proj / lm_head weights stored [in, out] (`layers.Linear`'s
  `in_major`; the modes above run a copy of the model with every weight [out, in], as before
  session 7);
- `decode_pdl`: and paged decode launched with programmatic dependent launch after the rotary
  kernel (`attention.DECODE_PDL_MAX_ROWS`, which this mode sets to 32 so that both batches use
  it; 0 in the modes above). Today's defaults are this mode at batch 1 and `in_major_w` at 32;
- `triton_gemv`: `decode_pdl` with every batch-1 linear through the Triton GEMV
  (`ModelOptions.triton_gemv`: the residual adds and LayerNorms inside the QKV, up_proj and
  lm_head GEMVs, GeGeLU inside up_proj's; the tiles of `gemv.TUNED_TILES`), launched with PDL
  (`gemv.GEMV_PDL`), on the [out, in] twin (the GEMV reads weight rows);
- `triton_gemv_nopdl`: the same without the GEMVs' PDL;
- `triton_gemv_norope`: `triton_gemv` with the rotary and K/V write in their own kernel again
  instead of inside the QKV GEMV (`attention.GEMV_ROPE`);
- `defaults`: what an engine gets today on a GPU: `triton_gemv` at batch 1, and at batch 32
  cuBLAS over the [out, in] weights with no decode PDL (`DECODE_PDL_MAX_ROWS` left at 1);
- `defaults_notrigger`: `defaults` with the paged-decode template's `merge_trigger` knob off
  (the separate split merge kernel no longer lets the O GEMV after it start early); every mode
  renders the decode kernels afresh (`kernels.base.forget`) with its knob;
- `s8_tiles`: `defaults` with session 8's up_proj, O, down_proj and lm_head GEMV tiles
  (`S8_TILES`), which the sweeps of GEMVs chained by PDL (session 8's call 9, session 9's call 6)
  replaced in session 9;
- `plain_argmax`: `defaults` with the greedy token from one torch.argmax per step instead of
  `sampling.greedy_argmax`'s two stages (`sampling.ARGMAX_CHUNK = 0`);
- `qk1`: `defaults` with the paged-decode template's QK k-steps in one chain of mma
  (`qk_accs=1`, the default before session 9) instead of two;
- `cublas_up`: `defaults` with every linear at 2..32 rows on cuBLAS (`layers.ROWS_LAYERS`
  emptied), with the fused GeGeLU and rotary kernels after them, as before session 10;
- `rows_up`: only up_proj + GeGeLU through `kernels.linear.gemm_rows` (session 10's default until call 11);
- `rows_qkv`, `rows_qkv_o`, `rows_all`: up_proj and QKV (today's default; at a decode step with
  the rotary and K/V write fused in), then also the output projection, then also down_proj;
- `norm_pdl`: `defaults` with every add + LayerNorm launched with PDL at batch 32 too
  (`fused.PDL_MAX_ROWS` = 32; it then waits for the kernel before it, which may have triggered);
- `rows_qkv_dpdl`, `rows_qkv_o_dpdl`: `rows_qkv` / `rows_qkv_o` with paged decode launched with
  PDL at batch 32 too (behind the QKV kernel, which triggers its dependents at its start).
Wall ms per step (async steps, as the engine runs by default), graph replay alone, and whether
the greedy tokens equal the first mode's (the switches change no arithmetic but the summation
order of the GEMV, and of the decode's scores under `qk1`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from profile_decode_step import engine_at, replay_ms, step_ms, sync
from torch import nn

from sparsegen.kernels import base as kernel_base
from sparsegen.kernels import decode_template
from sparsegen.kernels.fused import add_norm as fused
from sparsegen.kernels.linear import gemv
from sparsegen.models import attention, layers, random_model
from sparsegen.runner import sampling


@dataclass(frozen=True)
class Mode:
    """One engine's switches (see the module docstring)."""

    pdl: bool  # add + LayerNorm with PDL (SPARSEGEN_NO_PDL unset)
    gemv_o: bool  # ModelOptions.gemv_o_proj
    kv_layout: str  # EngineConfig.kv_layout
    in_major: bool  # the model as loaded (down_proj, lm_head [in, out]); False: the [out, in] twin
    decode_pdl: bool | None  # paged decode with PDL at both batches / at neither; None: the module's rule
    triton_gemv: bool = False  # every batch-1 linear through the Triton GEMV
    gemv_pdl: bool = False  # gemv.GEMV_PDL
    rope: bool = True  # attention.GEMV_ROPE
    merge_trigger: bool = True  # the decode template's merge_trigger knob
    s8_tiles: bool = False  # S8_TILES over gemv.TUNED_TILES
    argmax_chunk: int = sampling.ARGMAX_CHUNK  # sampling.ARGMAX_CHUNK (0: torch.argmax)
    qk_accs: int = decode_template.DEFAULT_KNOBS["qk_accs"]  # the decode template's qk_accs knob
    rows_layers: tuple | None = None  # layers.ROWS_LAYERS: None = as shipped
    norm_pdl_rows: int | None = (
        None  # fused.PDL_MAX_ROWS (add + LayerNorm launched with PDL): None = as shipped
    )


_GEMV = dict(pdl=True, gemv_o=True, kv_layout="head", in_major=False, triton_gemv=True, gemv_pdl=True)
MODES = {
    "base": Mode(False, False, "token", False, False),
    "pdl": Mode(True, False, "token", False, False),
    "pdl+gemv_o": Mode(True, True, "token", False, False),
    "head_kv": Mode(True, True, "head", False, False),
    "in_major_w": Mode(True, True, "head", True, False),
    "decode_pdl": Mode(True, True, "head", True, True),
    "triton_gemv": Mode(**_GEMV, decode_pdl=True),
    "triton_gemv_nopdl": Mode(**{**_GEMV, "gemv_pdl": False}, decode_pdl=True),
    "triton_gemv_norope": Mode(**_GEMV, decode_pdl=True, rope=False),
    "defaults": Mode(**_GEMV, decode_pdl=None),
    "defaults_notrigger": Mode(**_GEMV, decode_pdl=None, merge_trigger=False),
    "s8_tiles": Mode(**_GEMV, decode_pdl=None, s8_tiles=True),
    "plain_argmax": Mode(**_GEMV, decode_pdl=None, argmax_chunk=0),
    "qk1": Mode(**_GEMV, decode_pdl=None, qk_accs=1),
    "cublas_up": Mode(**_GEMV, decode_pdl=None, rows_layers=()),
    "rows_up": Mode(**_GEMV, decode_pdl=None, rows_layers=((28672, 4096),)),
    "rows_qkv": Mode(**_GEMV, decode_pdl=None, rows_layers=((28672, 4096), (6144, 4096))),
    "rows_qkv_o": Mode(**_GEMV, decode_pdl=None, rows_layers=((28672, 4096), (6144, 4096), (4096, 4096))),
    "rows_all": Mode(
        **_GEMV, decode_pdl=None, rows_layers=((28672, 4096), (6144, 4096), (4096, 4096), (4096, 14336))
    ),
    "norm_pdl": Mode(**_GEMV, decode_pdl=None, norm_pdl_rows=32),
    "rows_qkv_dpdl": Mode(**_GEMV, decode_pdl=True, rows_layers=((28672, 4096), (6144, 4096))),
    "rows_qkv_o_dpdl": Mode(
        **_GEMV, decode_pdl=True, rows_layers=((28672, 4096), (6144, 4096), (4096, 4096))
    ),
}
DEFAULT_DECODE_PDL_MAX_ROWS = attention.DECODE_PDL_MAX_ROWS
DEFAULT_TILES = dict(gemv.TUNED_TILES)
DEFAULT_ROWS_LAYERS = set(layers.ROWS_LAYERS)
DEFAULT_NORM_PDL_ROWS = fused.PDL_MAX_ROWS
S8_TILES = {  # gemv.TUNED_TILES keys -> tiles (block_n, block_k, warps, prefetch, row_sum)
    (28672, 4096, "gegelu", True): (8, 256, 4, True, False),  # call 9: 59.15 us against 56.64
    (4096, 4096, "plain", False): (4, 1024, 4, True, True),  # call 9: 9.84 us against 9.10
    (4096, 14336, "plain", False): (4, 2048, 4, False, False),  # s9 call 6: 28.71 us against 28.41
    (100352, 4096, "plain", True): (16, 512, 4, True, False),  # s9 call 6: 188.04 us against 182.41
}


def ab_models(script: str, row_major: bool) -> dict:
    """{True: the random 7b model as the loaders build it (down_proj and lm_head in-major), and,
    if `row_major`, False: the same weights with every linear stored [out, in] (contiguous)}."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    models = {True: random_model("7b", device="cuda", dtype=torch.bfloat16, seed=0)}
    if row_major:
        twin = random_model("7b", device="cuda", dtype=torch.bfloat16, seed=0)
        for mod in twin.modules():
            if isinstance(mod, nn.Linear) and not mod.weight.is_contiguous():
                mod.weight = nn.Parameter(mod.weight.contiguous(), requires_grad=False)
        torch.cuda.empty_cache()
        models[False] = twin
    return models


def run_mode(models, mode: str, batch: int, context: int, steps: int) -> dict:
    m = MODES[mode]
    gemv.GEMV_PDL = m.gemv_pdl  # this and the rest: read when a graph is captured
    decode_template.DEFAULT_KNOBS["merge_trigger"] = int(m.merge_trigger)
    decode_template.DEFAULT_KNOBS["qk_accs"] = m.qk_accs
    kernel_base.forget()  # the next lookup renders the decode kernels with this mode's knob
    sampling.ARGMAX_CHUNK = m.argmax_chunk
    gemv.TUNED_TILES.clear()
    gemv.TUNED_TILES.update({**DEFAULT_TILES, **(S8_TILES if m.s8_tiles else {})})
    attention.GEMV_ROPE = m.rope
    fused.PDL_MAX_ROWS = DEFAULT_NORM_PDL_ROWS if m.norm_pdl_rows is None else m.norm_pdl_rows
    layers.ROWS_LAYERS.clear()
    layers.ROWS_LAYERS.update(DEFAULT_ROWS_LAYERS if m.rows_layers is None else m.rows_layers)
    model = models[m.in_major]
    rows = DEFAULT_DECODE_PDL_MAX_ROWS if m.decode_pdl is None else 32 if m.decode_pdl else 0
    attention.DECODE_PDL_MAX_ROWS = rows
    if m.pdl:
        os.environ.pop("SPARSEGEN_NO_PDL", None)
    else:
        os.environ["SPARSEGEN_NO_PDL"] = "1"
    model.set_triton_gemv(m.triton_gemv, o_proj=m.gemv_o)
    args = SimpleNamespace(batch=batch, context=context, steps=steps)
    engine = engine_at(model, args, graphs=True, kv_layout=m.kv_layout)
    seqs = sorted(engine.scheduler.running, key=lambda s: s.seq_id)
    wall = min(step_ms(engine, steps) for _ in range(3))
    replay = replay_ms(engine)
    engine.step()
    sync()
    tokens = [list(s.output_ids[:12]) for s in seqs]
    del engine, seqs
    torch.cuda.empty_cache()
    return {"batch": batch, "mode": mode, "step_ms": wall, "replay_ms": replay, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    models = ab_models("ab_decode_step", any(not MODES[m].in_major for m in modes))
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        base = None
        for rnd in range(args.rounds):
            for mode in modes:
                r = run_mode(models, mode, batch, args.context, args.steps)
                base = r["tokens"] if base is None else base
                r.update(round=rnd, same_tokens_as_first=r.pop("tokens") == base)
                rows.append(r)
                print(f"b{batch} round {rnd} {mode:11s} step {r['step_ms']:.3f} ms  replay {r['replay_ms']:.3f} ms"
                      f"  tokens same as the first mode's: {r['same_tokens_as_first']}", flush=True)  # fmt: skip
    os.environ.pop("SPARSEGEN_NO_PDL", None)
    attention.DECODE_PDL_MAX_ROWS = DEFAULT_DECODE_PDL_MAX_ROWS
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
