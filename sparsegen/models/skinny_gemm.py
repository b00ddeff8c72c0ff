"""`x @ W.T + b` for a few rows (a decode batch): a Triton GEMM that streams W once at full speed.

A decode step at batch 32 reads every weight once, like batch 1, but cuBLAS's kernels for 32
rows read the 7b layers at 75-90 % of the copy rate on the H200 (session 6 profile: QKV 15.8 us
against an 11.9 us floor, up_proj 61.2 against 55.4). Here one program owns BLOCK_N output
columns for all M rows: it walks K in BLOCK_K steps, loading a [BLOCK_N, BLOCK_K] tile of W
(software-pipelined over `num_stages` tiles, so enough bytes are in flight) and the matching
[BLOCK_M, BLOCK_K] rows of x (from L2: x is small), and accumulates x . W^T on the tensor
cores in float32. No split over K, so no second pass. Rounding as the plain linear: the float32
sum plus bias, rounded once to the output dtype.

Imported only where it is used (a GPU): a @triton.jit kernel is bound to Triton's interpreter,
or not, when it is defined.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import InputError

MAX_ROWS = 64  # rows of x one launch takes (BLOCK_M is the next power of two >= M, >= 16)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 32
    block_k: int = 256
    num_stages: int = 4
    num_warps: int = 4


@triton.jit
def _skinny_kernel(
    X, W, B, Y, M, N, stride_xm, stride_wn, stride_ym,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # X: [M, K] (rows stride_xm, contiguous along K); W: [N, K] (rows stride_wn, contiguous along
    # K); B: [N]; Y: [M, N]. Program p: columns p * BLOCK_N ..., every row. K % BLOCK_K == 0.
    pid = tl.program_id(0).to(tl.int64)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns (W rows)
    rm = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = W + rn[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = X + rm[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptr, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Y.dtype.element_ty)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """The shapes this kernel takes: 1..MAX_ROWS rows, K a multiple of block_k, K contiguous."""
    m, k = x.shape
    return 1 <= m <= MAX_ROWS and k % block_k == 0 and weight.stride(1) == 1 and x.stride(1) == 1


def skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: SkinnyConfig | None = None,
) -> torch.Tensor:  # [M, N]
    """`F.linear(x, weight, bias)` for 1..MAX_ROWS rows (see the module docstring)."""
    cfg = config or SkinnyConfig()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise InputError(f"skinny_linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise InputError(
            f"skinny_linear: x is {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}"
        )
    if not supports(x, weight, cfg.block_k):
        raise InputError(
            f"skinny_linear takes 1..{MAX_ROWS} rows with K a multiple of {cfg.block_k}, contiguous "
            f"along K; got x {tuple(x.shape)} stride {x.stride()}, weight stride {weight.stride()}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype):
        raise InputError(f"skinny_linear: bias must be [{n}] {weight.dtype}, got {tuple(bias.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, cfg.block_n),)
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, x.stride(0), weight.stride(0), y.stride(0),
        K=k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y
