"""Batch-1 linear layers as a Triton GEMV: `x @ W.T + b` for one row, with what surrounds it fused.

    y = gemv(x, weight, bias)                                   # x: [1, K], weight: [N, K] -> [1, N]
    y, summed = gemv(x, w_qkv, b_qkv, norm=(res, ln_w, ln_b, eps), rope=RopeWrite(...))

A batch-1 decode step is the weights read once (15.6 GB for 7b). cuBLAS reads the big
matrices at ~4.0 TB/s but the two 4096-wide ones at ~3.0 TB/s, and it splits K for `dense` and
`down_proj` with a separate reduce kernel (64 extra launches per step, H200 profile). The
kernel (templates/gemv.py.jinja) reads W once in [BLOCK_N, BLOCK_K] tiles, one program per
BLOCK_N outputs (the tile per 7b shape measured on the H200: TUNED_TILES), and adds the bias in
the same pass. Fused in:
- `norm`: the residual add + LayerNorm that precedes QKV, up_proj and lm_head; each program
  computes the row's statistics itself from the 4096 inputs (16 KB with the residual, from
  cache) instead of waiting for a separate norm kernel (65 launches fewer per step);
- `gegelu_limit`: up_proj's GeGeLU over each (gate, linear) pair of outputs, so the [2F]
  intermediate never reaches memory; `glu` ("silu" or "gelu_tanh"): the decoder families'
  SwiGLU / GeGLU over a fused gate/up weight's (gate, up) row pairs, act(gate) * up;
- `norm_kind` ("rms", "rms1p"): the families' RMSNorm (Gemma's 1 + w) instead of the LayerNorm;
- `rope` (a decode token's QKV): the rotary embedding of q and k and the K/V cache write, so
  the paged decode kernel follows the GEMV directly.
On a GPU the GEMVs launch with programmatic dependent launch, so each one's first weight tile
is read while the kernel before it ends. With the GEMV a 7b batch-1 step took 4.24 ms on the
H200 against 4.97 ms on cuBLAS (`benchmarks/engine/ab_decode_step.py`). Rounding matches the plain
path: the fp32 sum plus bias is rounded to the output dtype, and GeGeLU and the rotary read
those rounded values, as `gegelu(linear(x))` and `fused.rotary.rotary_qkv` do. Runs in
Triton's interpreter (fp16/fp32) for the CPU tests.

Every launch is a request of the lifecycle (`kernels.triton_kernel`): built once, cached on
disk, and `request(...)` names the one a launch of given shapes makes, for building ahead of time.
"""

from __future__ import annotations

import torch

from ...errors import InputError
from ..families.model_triton import GEMV
from ..launch_target import Target, target_of
from ..triton_kernel import TritonLauncher
from .rope_write import RopeWrite

TILE_ELEMS = 4096  # elements of W per program and iteration (8 KB of bf16), untuned shapes
PROGRAMS_PER_SM = 8
# The fastest tile of each 7b shape on an H200 (`benchmarks/linear/bench_gemv.py --sweep`: one row,
# CUDA-graph replays over weight copies far above the L2; dense, up_proj, down_proj and lm_head
# from sweeps of GEMVs chained by PDL, each adopted after an engine A/B):
# (weight rows N, K, mode, norm) -> (block_n, block_k, num_warps, prefetch, row_sum); block_n
# counts outputs, i.e. row pairs in the "gegelu" and "rope" modes.
TUNED_TILES = {
    (4096, 4096, "plain", False): (2, 2048, 4, True, False),  # dense (O): 9.10 us, cuBLAS 12.9
    (4096, 14336, "plain", False): (16, 1024, 8, True, False),  # down_proj: 28.41 us, cuBLAS 31.7
    (6144, 4096, "plain", True): (8, 1024, 4, False, True),  # add + LN + QKV: 16.1 us, 19.2 as 2 kernels
    (6144, 4096, "rope", True): (8, 512, 4, True, False),  # + rotary and K/V write: 16.4 us, 21.1 as 3
    (28672, 4096, "gegelu", True): (2, 4096, 4, True, True),  # add + LN + up + GeGeLU: 56.6 us, 65.0 as 3
    (100352, 4096, "plain", True): (4, 4096, 4, True, True),  # add + LN + lm_head: 182.4 us, 201.5 as 2
}
GLU_ACTS = {"silu": 1, "gelu_tanh": 2}  # the kernel's ACT constexpr (0: GeGeLU)
NORM_KINDS = {"layer": 0, "rms": 1, "rms1p": 2}  # its NORM_KIND constexpr (as `fused.add_norm`'s)
GEMV_PDL = True  # launch with programmatic dependent launch where the target allows it (see the kernel)


LAUNCH = TritonLauncher(GEMV)


def _pow2_at_least(n: int) -> int:
    """triton.next_power_of_2 (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def tile_for(n: int, k: int, mode: str, norm: bool, target: Target) -> tuple:
    """(block_n, block_k, num_warps, prefetch, row_sum) for weight rows n: TUNED_TILES on a GPU
    where the shape is there; else block_n from block_n_for, TILE_ELEMS of W per iteration, 4
    warps, prefetch on (measured on the H200: without it the LayerNorm + up_proj + GeGeLU GEMV
    took 89.9 us instead of 60.9 with the same tile), per-tile row sums off."""
    tuned = TUNED_TILES.get((n, k, mode, norm)) if target.cuda else None
    if tuned is not None:
        return tuned
    n_out = n if mode == "plain" else n // 2
    block_n = block_n_for(n_out, PROGRAMS_PER_SM * target.sm_count)
    return block_n, _block_k(block_n, k, mode), 4, True, False


def _block_k(block_n: int, k: int, mode: str) -> int:
    rows_read = block_n if mode == "plain" else 2 * block_n  # both row sets of a paired program
    return min(_pow2_at_least(k), max(16, TILE_ELEMS // rows_read))


def block_n_for(n_out: int, programs: int) -> int:
    """The largest BLOCK_N in 1..16 (a power of two) that still gives `programs` programs."""
    block = 16
    while block > 1 and -(-n_out // block) < programs:
        block //= 2
    return block


def _row(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InputError(f"gemv takes one row: {name} must be [K] or [1, K], got {tuple(t.shape)}")
    return t


def gemv(
    x: torch.Tensor,  # [1, K] or [K]
    weight: torch.Tensor,  # [N, K], rows contiguous along K (nn.Linear.weight)
    bias: torch.Tensor | None = None,  # [N]
    *,
    gegelu_limit: float | None = None,
    norm: tuple | None = None,  # (residual [1, K] or None, ln_weight [K], ln_bias [K] or None, eps)
    rope: RopeWrite | None = None,
    glu: str | None = None,
    norm_kind: str = "layer",
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    prefetch: bool | None = None,
    row_sum: bool | None = None,
    pdl: bool | None = None,
):
    """`linear(x, weight, bias)` for one row -> [1, N]; with `gegelu_limit`,
    `gegelu(linear(...), limit)` over the interleaved (gate, linear) columns (Phi-3-Small's
    up_proj) -> [1, N // 2]; with `rope` (a QKV projection, see RopeWrite), the rotated queries
    [1, Hkv * G * D], k and v written into the caches only; with `glu`, act(gate) * up over the
    interleaved (gate, up) rows -> [1, N // 2]. With `norm`, the input is first
    `layer_norm(x + residual)` (x alone when residual is None; the RMSNorm of `norm_kind` with a
    bias of None), as `layers.add_norm` computes it,
    and the call returns `(y, x + residual)` (`(y, x)` without a residual). block_n / block_k /
    num_warps override the heuristic or TUNED_TILES, and prefetch / row_sum / pdl pick the
    kernel's variants (benchmarks; see the kernel; pdl defaults to GEMV_PDL where the device
    allows it, `launch_target.pdl_capable`)."""
    planned = _plan(x, weight, bias, gegelu_limit, norm, rope, block_n, block_k, num_warps, prefetch, row_sum,
                    pdl, target_of(x.device), glu, norm_kind)  # fmt: skip
    y, res_out, launch = planned
    if launch is not None:
        LAUNCH(*launch)
    if norm is None:
        return y
    return y, res_out[None, :]


def request(x, weight, bias=None, *, target: Target, arch: str, **options):
    """The request a `gemv(x, weight, bias, **options)` launch makes on a GPU of `arch` described
    by `target` (tensors may be on the meta device); None if the launch computes nothing."""
    planned = _plan(x, weight, bias, options.get("gegelu_limit"), options.get("norm"), options.get("rope"),
                    None, None, 4, None, None, options.get("pdl"), target, options.get("glu"),
                    options.get("norm_kind", "layer"))  # fmt: skip
    launch = planned[2]
    return None if launch is None else LAUNCH.request(launch[1], launch[2], launch[3], launch[4], arch)


def _plan(x, weight, bias, gegelu_limit, norm, rope, block_n, block_k, num_warps, prefetch, row_sum, pdl,
          target: Target, glu: str | None = None, norm_kind: str = "layer"):  # fmt: skip
    """Checks, the outputs and the launch: (y, res_out, (grid, args, constexprs, options, dtype)),
    or (y, res_out, None) when there are no outputs (the residual sum is then computed here)."""
    x = _row(x, "x")
    n, k = weight.shape
    if x.shape[0] != k or weight.stride(1) != 1 or x.dtype != weight.dtype or x.device != weight.device:
        raise InputError(
            f"gemv: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit weight {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device} with stride {weight.stride()} (needs stride 1 along K)"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype):
        raise InputError(f"gemv: bias must be [{n}] {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if glu is not None and glu not in GLU_ACTS:
        raise InputError(f"gemv: glu must be one of {tuple(GLU_ACTS)}, got {glu!r:.40}")
    if norm_kind not in NORM_KINDS:
        raise InputError(f"gemv: norm_kind must be one of {tuple(NORM_KINDS)}, got {norm_kind!r:.40}")
    paired = gegelu_limit is not None or glu is not None
    if paired and n % 2:
        raise InputError(f"gemv with GeGeLU / glu needs an even number of weight rows, got {n}")
    if sum(v is not None for v in (gegelu_limit, rope, glu)) > 1:
        raise InputError("gemv takes gegelu_limit, glu or rope, one at most (not both of any two)")
    mode = "gegelu" if paired else "rope" if rope is not None else "plain"
    x = x.contiguous()
    res = lnw = lnb = None
    eps = 0.0
    if norm is not None:
        if not (isinstance(norm, tuple) and len(norm) == 4):
            raise InputError("gemv: norm must be (residual or None, ln_weight, ln_bias, eps)")
        res, lnw, lnb, eps = norm
        if res is not None:
            res = _row(res, "residual").contiguous()
        for name, t in (("residual", res), ("ln_weight", lnw), ("ln_bias", lnb)):
            if t is not None and (t.shape != (k,) or t.dtype != x.dtype or t.device != x.device):
                raise InputError(f"gemv: {name} must be [{k}] {x.dtype} on {x.device}, got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip
        if lnw is None or (lnb is None) != (norm_kind != "layer"):
            raise InputError("gemv: norm needs the LayerNorm's weight and bias (an RMSNorm's weight only)")
    n_out = n if mode == "plain" else n // 2  # programs' outputs: rows, or row pairs
    dummy = x  # pointers a constexpr-disabled branch never reads
    cos = sin = kc = vc = slot = dummy
    cache_strides, head_d, group = (1, 0, 0, 0), 1, 1
    if rope is not None:
        cos, sin = (t.reshape(-1) for t in rope.checked(n, 1, x, "gemv rope"))  # [D] each
        kc, vc, slot = rope.k_cache, rope.v_cache, rope.slot
        cache_strides = (kc.shape[1], kc.stride(0), kc.stride(1), kc.stride(2))
        head_d, group = kc.shape[3], rope.group
        y = torch.empty((1, kc.shape[2] * group * head_d), dtype=x.dtype, device=x.device)  # queries
    else:
        y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if res is not None else x  # [K]
    if not n_out:
        if res is not None:
            res_out.copy_(x + res)
        return y, res_out, None
    tile = tile_for(n, k, mode, norm is not None, target)
    if block_n is not None or block_k is not None:  # an explicit tile keeps the given warps
        bn = block_n or tile[0]
        tile = (bn, block_k or _block_k(bn, k, mode), num_warps, *tile[3:])
    block_n, block_k, num_warps, t_prefetch, t_row_sum = tile
    prefetch = t_prefetch if prefetch is None else prefetch
    row_sum = t_row_sum if row_sum is None else row_sum
    if pdl is None:
        pdl = GEMV_PDL and target.cuda and target.pdl
    args = (
        x, weight, bias if bias is not None else dummy, y, n, weight.stride(0),
        float(gegelu_limit) if gegelu_limit is not None else 0.0,
        res if res is not None else dummy, lnw if lnw is not None else dummy,
        lnb if lnb is not None else dummy, res_out, float(eps),
        cos, sin, kc, vc, slot, *cache_strides,
    )  # fmt: skip
    constexprs = (k, _pow2_at_least(k), bias is not None, mode == "gegelu", norm is not None, res is not None,
                  block_n, block_k, bool(prefetch), bool(row_sum), bool(pdl), mode == "rope", head_d, group,
                  NORM_KINDS[norm_kind], GLU_ACTS.get(glu, 0))  # fmt: skip
    options = (("num_warps", num_warps), ("launch_pdl", bool(pdl)))
    return y, res_out, ((-(-n_out // block_n), 1, 1), args, constexprs, options, x.dtype)
