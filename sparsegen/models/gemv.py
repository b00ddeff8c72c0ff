"""Batch-1 linear layers as a Triton GEMV: `x @ W.T + b` for one row, optionally with GeGeLU fused.

A batch-1 decode step is the weights read once (15.6 GB for 7b). cuBLAS reads the big
matrices at ~4.0 TB/s but the two 4096-wide ones at ~3.0 TB/s, and it splits K for `dense` and
`down_proj` with a separate reduce kernel (64 extra launches per step; H200 profile, session 2).
This kernel reads W once in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N outputs, with
enough programs (about 8 per SM) to keep the loads in flight, and adds the bias in the same
pass; for `up_proj` it also applies GeGeLU to each (gate, linear) pair of outputs, so the
[2F] intermediate never reaches memory (one launch fewer per layer). With `norm` it also does
the residual add + LayerNorm that precedes QKV, up_proj and lm_head: each program computes the
row's statistics itself from the 4096 inputs (16 KB, from cache) instead of waiting for a
separate norm kernel (65 launches fewer per step).

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
def _summed(X, RES, kk, k_ok, HAS_RES: tl.constexpr):
    # x + residual at columns kk, rounded to x's dtype as the plain add rounds, as float32.
    s = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        s += tl.load(RES + kk, mask=k_ok, other=0.0).to(tl.float32)
        s = s.to(X.dtype.element_ty).to(tl.float32)
    return s


@triton.jit
def _gemv_kernel(
    X, W, B, Y, N, stride_w, limit, RES, LNW, LNB, RES_OUT, eps,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GEGELU: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # K is a constexpr: a model has two (hidden and intermediate size), and a known trip count
    # lets the loop be pipelined (and Triton's interpreter cannot loop to a runtime int).
    # X: [K]; W: [N, K] rows with stride stride_w, contiguous along K; B: [N]; Y: [N], or [N // 2]
    # with GEGELU (output i from W rows 2i (gate) and 2i + 1 (linear)). One program: BLOCK_N
    # outputs (BLOCK_N pairs of rows with GEGELU).
    # NORM: the input is LayerNorm(X + RES) * LNW + LNB (RES only with HAS_RES), each program
    # computing the row's mean and variance itself (two passes over the K inputs, from cache);
    # program 0 also writes X + RES to RES_OUT. Rounded where add + F.layer_norm round.
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
    mean = 0.0
    rstd = 1.0
    if NORM:
        tot = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            s = _summed(X, RES, kk, k_ok, HAS_RES)
            tot += s
            if HAS_RES:
                if pid == 0:
                    tl.store(RES_OUT + kk, s.to(RES_OUT.dtype.element_ty), mask=k_ok)
        mean = tl.sum(tot, axis=0) / K
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            d = tl.where(k_ok, _summed(X, RES, kk, k_ok, HAS_RES) - mean, 0.0)
            sq += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    acc_a = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        if NORM:
            s = _summed(X, RES, kk, k_ok, HAS_RES)
            lw = tl.load(LNW + kk, mask=k_ok, other=0.0).to(tl.float32)
            lb = tl.load(LNB + kk, mask=k_ok, other=0.0).to(tl.float32)
            h = ((s - mean) * rstd * lw + lb).to(X.dtype.element_ty)  # where the LayerNorm rounds
            x = tl.where(k_ok, h.to(tl.float32), 0.0)[None, :]
        else:
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
    norm: tuple | None = None,  # (residual [1, K] or None, ln_weight [K], ln_bias [K], eps)
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
):
    """`linear(x, weight, bias)` for one row -> [1, N]; with `gegelu_limit`,
    `gegelu(linear(...), limit)` over the interleaved (gate, linear) columns (Phi-3-Small's
    up_proj) -> [1, N // 2]. With `norm`, the input is first `layer_norm(x + residual)` (x alone
    when residual is None), as `layers.add_norm` computes it, and the call returns
    `(y, x + residual)` (`(y, x)` without a residual). block_n / block_k / num_warps override the
    heuristic (benchmarks)."""
    x = _row(x, "x")
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
        if lnw is None or lnb is None:
            raise InputError("gemv: norm needs the LayerNorm's weight and bias")
    n_out = n // 2 if gegelu_limit is not None else n
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if res is not None else x  # [K]
    if n_out:
        if block_n is None:
            block_n = block_n_for(n_out, PROGRAMS_PER_SM * _sm_count(x.device))
        if block_k is None:  # TILE_ELEMS of W per iteration (both row sets of a GeGeLU program together)
            rows_read = 2 * block_n if gegelu_limit is not None else block_n
            block_k = min(triton.next_power_of_2(k), max(16, TILE_ELEMS // rows_read))
        grid = (triton.cdiv(n_out, block_n),)
        dummy = x  # pointers a constexpr-disabled branch never reads
        _gemv_kernel[grid](
            x, weight, bias if bias is not None else dummy, y, n, weight.stride(0),
            float(gegelu_limit) if gegelu_limit is not None else 0.0,
            res if res is not None else dummy, lnw if lnw is not None else dummy,
            lnb if lnb is not None else dummy, res_out, float(eps),
            K=k, HAS_BIAS=bias is not None, GEGELU=gegelu_limit is not None, NORM=norm is not None,
            HAS_RES=res is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )  # fmt: skip
    elif res is not None:
        res_out.copy_(x + res)
    if norm is None:
        return y
    return y, res_out[None, :]
