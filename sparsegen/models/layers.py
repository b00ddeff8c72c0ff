"""The building blocks of the model modules (models.phi3small, models.families): uninitialised Linear and
Embedding (with Linear's in-major weight storage), the families' RMSNorm, where a linear layer
runs (cuBLAS, the Triton GEMV or the few-row CUDA GEMM: `ROWS_LAYERS`), the residual add +
LayerNorm / RMSNorm and GeGeLU.
The kernels themselves are `sparsegen.kernels.linear` and `sparsegen.kernels.fused`; this is
the policy of when the model uses them. Activations are `[T, features]` for the T tokens of a
batch.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..kernels.fused import add_norm as add_norm_kernel
from ..kernels.linear import gemm_rows as rows_kernel
from ..kernels.linear import gemv as gemv_kernel

# The weights ([out, in]) that the model runs through the few-row GEMM (`kernels.linear.gemm_rows`)
# at 2..32 rows (`rows_gemm`), from one-process A/Bs of 7b batch-32 steps on the H200
# (`benchmarks/engine/ab_decode_step.py`):
# - up_proj with GeGeLU fused in: 0.05 ms faster than cuBLAS + the GeGeLU kernel;
# - QKV, at a decode step with the rotary and K/V write fused in: 0.027 ms more;
# - the output projection with the x-resident tile: 0.013-0.024 ms more (10.671 / 10.682 ->
#   10.658 / 10.658 ms; with the ring tile it lost 0.08 ms).
# down_proj loses there (+0.43 ms). Empty: cuBLAS.
ROWS_LAYERS = {(28672, 4096), (6144, 4096), (4096, 4096)}


def gegelu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """GeGeLU over interleaved halves: even columns are the gate, odd ones the linear part."""
    gate = x[..., 0::2].clamp(max=limit)
    linear = x[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(1.702 * gate) * (linear + 1.0)


class _NoInit:
    """Parameters are allocated, never initialised: the loader or `random_model` fills each one.

    (Building on the meta device instead would run torch's Python init refs, which import
    torch._dynamo and with it Triton, before a test can turn on TRITON_INTERPRET.)
    """

    def reset_parameters(self) -> None:
        pass


class Linear(_NoInit, nn.Linear):
    """nn.Linear. With `in_major=True` the weight is stored as a contiguous [in, out] tensor and
    seen as the usual [out, in] through `.t()`, so F.linear hands cuBLAS the no-transpose layout.
    On an H200 that ran the decode step's skinny GEMMs faster for down_proj (1 / 32 rows: 32.5 /
    31.8 -> 31.7 / 30.8 us) and lm_head (197 / 203 -> 186 / 191 us) and left the 8192-row prefill
    GEMM unchanged (benchmarks/linear/bench_linear_layout.py, benchmarks/results/HISTORY.md); qkv, dense and
    up_proj gained nothing there or lost at 8192 rows, so they stay [out, in]. The Triton GEMV
    reads [out, in] rows only: a model built with `ModelOptions.triton_gemv` keeps every weight
    [out, in], and an in-major layer of one switched to it later stays on cuBLAS (`linear`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, in_major: bool = False, **fk
    ):
        super().__init__(in_features, out_features, bias=bias, **fk)
        if in_major:
            self.weight = nn.Parameter(torch.empty(in_features, out_features, **fk).t())  # [out, in] view


class Embedding(_NoInit, nn.Embedding):
    pass


class RMSNorm(nn.Module):
    """x / rms(x) * w in float32, cast back before the weight, as transformers' Llama does; with
    `offset` (Gemma's 1), x / rms(x) * (offset + w) all in float32, then cast, as Gemma does."""

    def __init__(self, size: int, eps: float, fk: dict, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.empty(size, **fk))

    @property
    def kind(self) -> str | None:
        """The fused kernels' norm kind (`fused.add_norm.NORM_KINDS`); None: no kernel has it."""
        return {0.0: "rms", 1.0: "rms1p"}.get(self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def norm_args(norm: nn.Module, residual: torch.Tensor | None) -> tuple[tuple, str]:
    """The GEMV's `norm=` tuple and `norm_kind` for a LayerNorm or an RMSNorm (`kernels.linear.gemv`)."""
    if isinstance(norm, RMSNorm):
        return (residual, norm.weight, None, norm.eps), norm.kind
    return (residual, norm.weight, norm.bias, norm.eps), "layer"


def fusable_norm(norm: nn.Module) -> bool:
    """Whether the fused kernels compute this norm: a LayerNorm, or an RMSNorm of offset 0 or 1."""
    return not isinstance(norm, RMSNorm) or norm.kind is not None


def fast_kernels(x: torch.Tensor) -> bool:
    """Use the hand-fused Triton kernels: eagerly on a GPU. Under torch.compile the plain ops are
    traced instead, and inductor fuses them itself."""
    return x.is_cuda and not torch.compiler.is_compiling()


def gemv_row(on: bool, x: torch.Tensor) -> bool:
    """One row (a batch-1 decode step) through the Triton GEMV (`ModelOptions.triton_gemv`): on a
    GPU, or in Triton's interpreter when it is active (the CPU tests); never under torch.compile."""
    if not on or torch.compiler.is_compiling() or x.shape[0] != 1:
        return False
    return x.is_cuda or ops.interpreter_usable()


def gemv_layer(layer: nn.Module, on: bool, x: torch.Tensor) -> bool:
    """`gemv_row` for a plain nn.Linear whose weight rows are contiguous (not `in_major`)."""
    return isinstance(layer, nn.Linear) and layer.weight.stride(1) == 1 and gemv_row(on, x)


def rows_gemm(layer: nn.Module, x: torch.Tensor, fused: bool) -> bool:
    """Whether `layer(x)` runs as `kernels.linear.gemm_rows` (the few-row CUDA linear): eagerly
    on an sm_90 GPU for 2..32 bf16 / fp16 rows of x that the kernel can read, a plain nn.Linear
    whose weight rows are contiguous, a weight shape that `ROWS_LAYERS` lists, and `fused` (not
    the plain reference model)."""
    if not fused or not fast_kernels(x) or x.dim() != 2 or not 2 <= x.shape[0] <= 32:
        return False
    if not isinstance(layer, nn.Linear) or x.dtype not in (torch.bfloat16, torch.float16):
        return False  # a tensor-parallel layer, or an fp32 model: cuBLAS
    w = layer.weight
    if tuple(w.shape) not in ROWS_LAYERS or w.dtype != x.dtype:
        return False
    return rows_kernel.operand_ok(x) and rows_kernel.operand_ok(w) and rows_kernel.supported(x.device)


def linear(layer: nn.Module, x: torch.Tensor, gemv: bool, fused: bool = False) -> torch.Tensor:
    """layer(x); x: [T, in] -> [T, out]. With `gemv` a single row through a plain nn.Linear goes
    through the Triton GEMV (a tensor-parallel layer, which also communicates, runs itself); with
    `fused`, 2..32 rows through `kernels.linear.gemm_rows` where `rows_gemm` says so."""
    if gemv_layer(layer, gemv, x):
        return gemv_kernel.gemv(x, layer.weight, layer.bias)
    if rows_gemm(layer, x, fused):
        return rows_kernel.gemm_rows(x, layer.weight, layer.bias)
    return layer(x)


def add_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, fused: bool, trigger: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); with no residual yet, (norm(x), x). x, residual: [T, hidden].
    norm: a LayerNorm or an RMSNorm. fused: one Triton kernel (GPU) instead of an add and a norm,
    same rounding points; trigger: it lets the PDL-launched kernel after it start early
    (`add_norm.add_layer_norm`)."""
    if fused and fast_kernels(x) and fusable_norm(norm):
        (_, w, b, eps), kind = norm_args(norm, None)
        return add_norm_kernel.add_layer_norm(x, residual, w, b, eps, trigger=trigger, kind=kind)
    if residual is not None:
        x = x + residual
    return norm(x), x
