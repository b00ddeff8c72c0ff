"""Batch-1 linear layers as a Triton GEMV: `x @ W.T + b` for one row, optionally with GeGeLU fused.

A batch-1 decode step is the weights read once (15.6 GB for 7b). cuBLAS reads the big
matrices at ~4.0 TB/s but the two 4096-wide ones at ~3.0 TB/s, and it splits K for `dense` and
`down_proj` with a separate reduce kernel (64 extra launches per step; H200 profile, session 2).
This kernel reads W once in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N outputs, with
enough programs (about 8 per SM) to keep the loads in flight, and adds the bias in the same
pass; for `up_proj` it also applies GeGeLU to each (gate, linear) pair of outputs, so the
[2F] intermediate never reaches memory (one launch fewer per layer).

Opt-in (`ModelOptions(triton_gemv=True)`): cuBLAS stays the default until the GPU measures this
faster (`benchmarks/bench_gemv.py`). Rounding matches the plain path: the fp32 sum plus bias is
rounded to the output dtype, and GeGeLU reads those rounded values, as `gegelu(linear(x))` does.
Runs in Triton's interpreter (fp16/fp32) for the CPU tests. Imported only where it is used: a
@triton.jit kernel is bound to the interpreter, or not, when it is defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError

TILE_ELEMS = 4096  # elements of W per program and iteration (8 KB of bf16)
PROGRAMS_PER_SM = 8


@triton.jit
def _gemv_kernel(
    X, W, B, Y, N, stride_w, limit,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GEGELU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # K is a constexpr: a model has two (hidden and intermediate size), and a known trip count
    # lets the loop be pipelined (and Triton's interpreter cannot loop to a runtime int).
    # X: [K]; W: [N, K] rows with stride stride_w, contiguous along K; B: [N]; Y: [N], or [N // 2]
    # with GEGELU (output i from W rows 2i (gate) and 2i + 1 (linear)). One program: BLOCK_N
    # outputs (BLOCK_N pairs of rows with GEGELU).
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output index
    ks = tl.arange(0, BLOCK_K)
    if GEGELU:
        n_out = N // 2
        r_a = 2 * rows  # gate rows
        r_b = 2 * rows + 1  # linear rows
    else:
        n_out = N
        r_a = rows
        r_b = rows
    ok = rows < n_out
    acc_a = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        x = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = ok[:, None] & k_ok[None, :]
        w_a = tl.load(W + r_a[:, None] * stride_w + kk[None, :], mask=m, other=0.0)
        acc_a += w_a.to(tl.float32) * x
        if GEGELU:
            w_b = tl.load(W + r_b[:, None] * stride_w + kk[None, :], mask=m, other=0.0)
            acc_b += w_b.to(tl.float32) * x
    y_a = tl.sum(acc_a, axis=1)
    if HAS_BIAS:
        y_a += tl.load(B + r_a, mask=ok, other=0.0).to(tl.float32)
    y_a = y_a.to(Y.dtype.element_ty)  # where the plain linear rounds
    if GEGELU:
        y_b = tl.sum(acc_b, axis=1)
        if HAS_BIAS:
            y_b += tl.load(B + r_b, mask=ok, other=0.0).to(tl.float32)
        y_b = y_b.to(Y.dtype.element_ty)
        gate = tl.minimum(y_a.to(tl.float32), limit)
        lin = tl.minimum(tl.maximum(y_b.to(tl.float32), -limit), limit)
        out = (gate * tl.sigmoid(1.702 * gate) * (lin + 1.0)).to(Y.dtype.element_ty)
    else:
        out = y_a
    tl.store(Y + rows, out, mask=ok)


def block_n_for(n_out: int, programs: int) -> int:
    """The largest BLOCK_N in 1..16 (a power of two) that still gives `programs` programs."""
    block = 16
    while block > 1 and -(-n_out // block) < programs:
        block //= 2
    return block


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # Triton's interpreter runs programs one by one: few, large ones
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv(
    x: torch.Tensor,  # [1, K] or [K]
    weight: torch.Tensor,  # [N, K], rows contiguous along K (nn.Linear.weight)
    bias: torch.Tensor | None = None,  # [N]
    *,
    gegelu_limit: float | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:  # [1, N], or [1, N // 2] with gegelu_limit
    """`linear(x, weight, bias)` for one row; with `gegelu_limit`, `gegelu(linear(...), limit)`
    over the interleaved (gate, linear) columns (Phi-3-Small's up_proj). block_n / block_k /
    num_warps override the heuristic (benchmarks)."""
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1:
        raise InputError(f"gemv takes one row: x must be [K] or [1, K], got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[0] != k or weight.stride(1) != 1 or x.dtype != weight.dtype or x.device != weight.device:
        raise InputError(
            f"gemv: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit weight {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device} with stride {weight.stride()} (needs stride 1 along K)"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype):
        raise InputError(f"gemv: bias must be [{n}] {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if gegelu_limit is not None and n % 2:
        raise InputError(f"gemv with GeGeLU needs an even number of weight rows, got {n}")
    x = x.contiguous()
    n_out = n // 2 if gegelu_limit is not None else n
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    if n_out == 0:
        return y
    if block_n is None:
        block_n = block_n_for(n_out, PROGRAMS_PER_SM * _sm_count(x.device))
    if block_k is None:  # TILE_ELEMS of W per iteration (both row sets of a GeGeLU program together)
        rows_read = 2 * block_n if gegelu_limit is not None else block_n
        block_k = min(triton.next_power_of_2(k), max(16, TILE_ELEMS // rows_read))
    grid = (triton.cdiv(n_out, block_n),)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else x, y, n, weight.stride(0),
        float(gegelu_limit) if gegelu_limit is not None else 0.0, K=k,
        HAS_BIAS=bias is not None, GEGELU=gegelu_limit is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps,
    )  # fmt: skip
    return y
