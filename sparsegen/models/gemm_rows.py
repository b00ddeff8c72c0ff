"""Few-row linear layers (a decode batch of 2-64 rows) as a Triton GEMM that streams the weight once.

A batch-32 decode step reads the weights once, like a batch-1 step, but 32 rows need the tensor
cores. This kernel computes the transposed product, Y^T[BLOCK_N, MP] = W[BLOCK_N, K] . X^T[K, MP]:
the weight rows fill the MMA's M side and the batch rows, padded to MP >= 16, its N side. One
program per BLOCK_N outputs reads its W rows once. Two ways to keep weight bytes in flight:
PREFETCH loads the next W (and X) tile into registers before the current one is multiplied (as
models.gemv does at one row; Triton's own pipelining off), otherwise Triton's software pipeline
streams the tiles through `STAGES` shared-memory buffers. With programmatic dependent launch each
program loads its first weight tile before it waits for the kernel before it.

An experiment of session 9 (`benchmarks/bench_gemm_rows.py`); the model does not use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from .fused import pdl_capable

MAX_ROWS = 64
DEFAULT_TILE = (64, 128, 4, 0)  # (block_n, block_k, num_warps, stages); stages 0 = PREFETCH


@triton.jit
def _gemm_rows_kernel(
    X, W, B, Y, M, N, stride_x, stride_w, stride_y,
    K: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # X: [M, K] rows with stride stride_x; W: [N, K] rows with stride stride_w, contiguous along
    # K; B: [N]; Y: [M, N] rows with stride stride_y. Program n: outputs n * BLOCK_N .. + BLOCK_N
    # of every row. K is a multiple of BLOCK_K (the launcher checks).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch; it waits for this one
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, MP)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]  # [MP, BLOCK_K]
    acc = tl.zeros((BLOCK_N, MP), dtype=tl.float32)
    if PREFETCH:
        w = tl.load(w_ptr, mask=n_ok[:, None], other=0.0)  # weights are never written: before the wait
        if PDL:
            tl.extra.cuda.gdc_wait()  # X is the previous kernel's output
        x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=1):
            more = k0 + BLOCK_K < K
            w_next = tl.load(w_ptr + k0 + BLOCK_K, mask=n_ok[:, None] & more, other=0.0)
            x_next = tl.load(x_ptr + k0 + BLOCK_K, mask=m_ok[:, None] & more, other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
            w = w_next
            x = x_next
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w = tl.load(w_ptr + k0, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k0, mask=m_ok[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_at = Y + rm[None, :].to(tl.int64) * stride_y + rn[:, None]  # [BLOCK_N, MP]
    tl.store(y_at, acc.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def gemm_rows(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, rows contiguous along K
    weight: torch.Tensor,  # [N, K], rows contiguous along K (nn.Linear.weight)
    bias: torch.Tensor | None = None,  # [N]
    *,
    tile: tuple[int, int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """`linear(x, weight, bias)` for a few rows -> [M, N], summed in float32 and rounded once.
    `tile` = (block_n, block_k, num_warps, stages), stages 0 = register prefetch; pdl defaults
    to `fused.pdl_capable` on a GPU."""
    if x.dim() != 2 or weight.dim() != 2:
        raise InputError(
            f"gemm_rows: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise InputError(f"gemm_rows takes 1..{MAX_ROWS} rows, got {m}")
    if (weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1 or x.dtype != weight.dtype
            or x.device != weight.device):  # fmt: skip
        raise InputError(
            f"gemm_rows: x {tuple(x.shape)} {x.dtype} {x.stride()} on {x.device} does not fit weight "
            f"{tuple(weight.shape)} {weight.dtype} {weight.stride()} on {weight.device} (both contiguous along K)"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype or bias.device != x.device):
        raise InputError(
            f"gemm_rows: bias must be [{n}] {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    block_n, block_k, warps, stages = tile or DEFAULT_TILE
    if k % block_k:
        raise InputError(f"gemm_rows: K={k} is not a multiple of block_k={block_k}")
    mp = max(16, triton.next_power_of_2(m))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if pdl is None:
        pdl = x.is_cuda and pdl_capable(x.device)
    _gemm_rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, m, n, x.stride(0), weight.stride(0), y.stride(0),
        K=k, MP=mp, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, PDL=bool(pdl),
        PREFETCH=stages == 0, STAGES=max(stages, 1), num_warps=warps, num_stages=max(stages, 1),
        launch_pdl=bool(pdl),
    )  # fmt: skip
    return y
