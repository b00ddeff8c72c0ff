"""Few-row linear layers (a decode batch of 2-64 rows) as a Triton split-K GEMM.

A batch-32 decode step reads the weights once, like a batch-1 step, but 32 rows need the
tensor cores. cuBLAS reads the two 4096-wide weights of a block at only ~2.8 TB/s at 32 rows
(qkv 16.5 us, O 12.2 us against floors of 11.9 and 7.9; session 7, bench_linear_layout), mostly
fixed cost: launch, pipeline fill, a wave too few programs. This kernel computes the transposed
product, Y^T[BLOCK_N, MP] = W[BLOCK_N, K] . X^T[K, MP] (the weight rows fill the MMA's M side,
the batch rows pad to MP >= 16 on its N side), splits K over SPLIT_K programs per output tile
so that a 4096-row weight still fills the GPU, and lets the last of those programs to finish
sum the float32 partials in a fixed order (deterministic), add the bias and round once. With
programmatic dependent launch each program loads its first weight tile before it waits for the
kernel before it.

Measured against cuBLAS on the H200 in `benchmarks/bench_gemm_rows.py`; the model uses it only
where that measured a gain (`TUNED`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from .fused import pdl_capable

MAX_ROWS = 64
# (N, K) -> (block_n, block_k, split_k, num_warps, num_stages) for up to 32 rows; filled from
# the H200 sweep of benchmarks/bench_gemm_rows.py.
TUNED: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}
DEFAULT_TILE = (64, 128, 1, 4, 3)


@triton.jit
def _gemm_rows_kernel(
    X, W, B, Y, WS, CNT, M, N, stride_x, stride_w, stride_y,
    K: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # X: [M, K] rows with stride stride_x; W: [N, K] rows with stride stride_w, contiguous along
    # K; B: [N]; Y: [M, N] rows with stride stride_y. Program (n, s): outputs n * BLOCK_N ..
    # + BLOCK_N of every row over K slice s (K // SPLIT_K columns, a multiple of BLOCK_K).
    # WS: [SPLIT_K, MP, N] float32 partials; CNT: [cdiv(N, BLOCK_N)] int32 arrival counters,
    # zero on entry and left zero (the last program of a tile resets its counter).
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch; it waits for this one
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    K_PER: tl.constexpr = K // SPLIT_K
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, MP)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k0 = split * K_PER
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + (k0 + rk)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = X + rm[:, None].to(tl.int64) * stride_x + (k0 + rk)[None, :]  # [MP, BLOCK_K]
    w = tl.load(w_ptr, mask=n_ok[:, None], other=0.0)  # weights are never written: before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()  # X is the previous kernel's output
    x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
    acc = tl.dot(w, tl.trans(x), out_dtype=tl.float32)  # [BLOCK_N, MP]
    for kk in tl.range(BLOCK_K, K_PER, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptr + kk, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptr + kk, mask=m_ok[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
    y_at = Y + rm[None, :].to(tl.int64) * stride_y + rn[:, None]  # [BLOCK_N, MP]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_at, acc.to(Y.dtype.element_ty), mask=ok)
    else:
        ws_at = WS + (split * MP + rm[None, :]) * N + rn[:, None]  # [BLOCK_N, MP]
        tl.store(ws_at, acc, mask=n_ok[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
        arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last program of this output tile: sum in split order
            tot = tl.zeros((BLOCK_N, MP), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part_at = WS + (s * MP + rm[None, :]) * N + rn[:, None]
                tot += tl.load(part_at, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_at, tot.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(CNT + pid_n, 0)  # ready for the next call


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}  # cache: (device, tiles) -> zeroed counters


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Arrival counters for `tiles` output tiles, zero between calls (each call resets them).
    One buffer per (device, tile count), shared by the calls of one stream in turn."""
    key = (str(device), tiles)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def tile_for(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_warps, num_stages): TUNED, else DEFAULT_TILE."""
    return TUNED.get((n, k), DEFAULT_TILE)


def gemm_rows(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, rows contiguous along K
    weight: torch.Tensor,  # [N, K], rows contiguous along K (nn.Linear.weight)
    bias: torch.Tensor | None = None,  # [N]
    *,
    tile: tuple[int, int, int, int, int] | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """`linear(x, weight, bias)` for a few rows -> [M, N], summed in float32 over K in a fixed
    order and rounded once. `tile` overrides `tile_for` (benchmarks); pdl defaults to
    `fused.pdl_capable` on a GPU."""
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
    block_n, block_k, split_k, warps, stages = tile or tile_for(n, k)
    if k % (split_k * block_k):
        raise InputError(f"gemm_rows: K={k} is not a multiple of split_k={split_k} x block_k={block_k}")
    mp = max(16, triton.next_power_of_2(m))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, block_n)
    ws = torch.empty((split_k, mp, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    cnt = _counters(x.device, tiles) if split_k > 1 else y
    if pdl is None:
        pdl = x.is_cuda and pdl_capable(x.device)
    _gemm_rows_kernel[(tiles, split_k)](
        x, weight, bias if bias is not None else y, y, ws, cnt, m, n, x.stride(0), weight.stride(0), y.stride(0),
        K=k, MP=mp, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None,
        PDL=bool(pdl), STAGES=stages, num_warps=warps, launch_pdl=bool(pdl),
    )  # fmt: skip
    return y
