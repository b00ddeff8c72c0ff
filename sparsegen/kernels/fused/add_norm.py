"""The residual add + LayerNorm (or RMSNorm) as one Triton kernel (templates/add_norm.py.jinja).

    y, summed = add_layer_norm(x, residual, weight, bias, eps)     # x, residual: [T, N]
    y, summed = add_layer_norm(x, residual, weight, None, eps, kind="rms")  # the decoder families'

A 7b decode step ran 65 of these as an add and a LayerNorm (8 us each on the H200). The kernel
rounds the sum to x's dtype before the norm and computes the norm in float32 from it, as
`x + residual` followed by `F.layer_norm` does (`models.layers.add_norm`'s plain path, the
tests' oracle). `kind` picks the norm (NORM_KINDS): "layer"; "rms", the families' RMSNorm rounded
to x's dtype before its weight multiplies (Llama's rounding); "rms1p", Gemma's x / rms(x) * (1 + w)
all in float32 before the one rounding (`models.layers.RMSNorm`).
"""

from __future__ import annotations

import torch

from ...errors import InputError
from ..families.model_triton import ADD_NORM
from ..launch_target import Target, pdl_allowed, target_of
from ..triton_kernel import TritonLauncher

NORM_KINDS = {"layer": 0, "rms": 1, "rms1p": 2}  # the kernel's KIND constexpr
PDL_MAX_ROWS = 32  # add + LayerNorm launched with PDL up to this many rows (use_pdl)


LAUNCH = TritonLauncher(ADD_NORM)


def use_pdl(x: torch.Tensor) -> bool:
    """Launch add + LayerNorm over x ([rows, N]) with programmatic dependent launch: on sm_90+, for
    up to PDL_MAX_ROWS rows, unless SPARSEGEN_NO_PDL. The kernel then waits (griddepcontrol.wait)
    for the kernel before it to finish before it reads anything, but is launched while that kernel
    still runs, which hides its launch latency.
    Measured on the H200 (`benchmarks/fused/bench_pdl.py`, a cuBLAS linear then the fused kernel, graph
    replays): O projection + add/LayerNorm 15.9 -> 14.8 us at batch 1 and 16.6 -> 15.7 us at 32;
    up_proj + GeGeLU unchanged; QKV + rotary slower (19.4 -> 20.0 us), so rotary and GeGeLU launch
    plainly. With QKV, O and up_proj through `gemm_rows` (which triggers its dependents at its
    start) a 7b batch-32 step went 10.839 / 10.867 -> 10.780 / 10.783 ms
    (`benchmarks/engine/ab_decode_step.py`, mode `norm_pdl`), hence 32 rows (2 to 31 not measured
    separately; longer prefills launch it plainly)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return pdl_allowed(x.device, rows, PDL_MAX_ROWS)


def add_layer_norm(x, residual, weight, bias, eps: float, pdl: bool | None = None, trigger: bool = False,
                   kind: str = "layer"):  # fmt: skip
    """x, residual: [T, N] (residual may be None) -> (LayerNorm(x + residual), x + residual), one
    kernel. weight, bias: [N] (bias None for the RMS kinds). The sum is rounded to x's dtype before the norm, as `x + residual`
    followed by `F.layer_norm` rounds. `trigger` (sm_90+): let a kernel launched after it with PDL
    start at once (it still waits for this one before it reads), as `linear.gemm_rows` does."""
    if pdl is None:
        pdl = use_pdl(x)
    y, res_out, launch = _plan(x, residual, weight, bias, eps, pdl, trigger, target_of(x.device), kind)
    if launch is not None:
        LAUNCH(*launch)
    return y, res_out


def request(x, residual, weight, bias, eps: float, *, pdl: bool, trigger: bool, target: Target, arch: str,
            kind: str = "layer"):  # fmt: skip
    """The request an `add_layer_norm(...)` launch makes on a GPU of `arch` described by `target`
    (tensors may be on the meta device); None for no rows."""
    launch = _plan(x, residual, weight, bias, eps, pdl, trigger, target, kind)[2]
    return None if launch is None else LAUNCH.request(*launch[1:], arch)


def _plan(x, residual, weight, bias, eps, pdl, trigger, target: Target, kind: str = "layer"):
    """The outputs and the launch (grid, args, constexprs, options, dtype), or None for no rows."""
    if kind not in NORM_KINDS:
        raise InputError(f"add_layer_norm: kind must be one of {tuple(NORM_KINDS)}, got {kind!r:.40}")
    if (bias is None) != (kind != "layer"):
        raise InputError(f"add_layer_norm: a {kind} norm takes {'a bias' if kind == 'layer' else 'no bias'}")
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        x = x.reshape(-1, x.shape[-1]).contiguous()
        residual = residual.reshape(-1, x.shape[-1]).contiguous() if residual is not None else None
    rows, n = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if not rows:
        return y, res_out, None
    block = 1 << (n - 1).bit_length() if n > 0 else 0  # triton.next_power_of_2
    warps = min(16, max(1, block // 256))
    args = (
        x, residual if residual is not None else x, weight, bias if bias is not None else weight, y, res_out,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), res_out.stride(0),
        n, float(eps),
    )  # fmt: skip
    constexprs = (residual is not None, block, pdl, bool(trigger) and target.pdl, NORM_KINDS[kind])
    return y, res_out, ((rows, 1, 1), args, constexprs, (("num_warps", warps), ("launch_pdl", pdl)), x.dtype)
