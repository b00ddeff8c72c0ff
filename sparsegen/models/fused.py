"""Fused elementwise steps of a Phi-3-Small block: the model's fast path on a GPU.

A batch-1 decode step of the 7b model spent about a fifth of its GPU time in some 700 tiny
kernels (benchmarks/results/HISTORY.md): rotary embedding with the KV-cache writes, GeGeLU, and each
residual add with the LayerNorm after it (65 LayerNorms of 8 us) ran as chains of PyTorch ops. Each function here does one such chain in one Triton kernel,
computing in float32 and rounding where the plain ops round. The plain versions
(`layers.gegelu`, `layers.add_norm`, `rope.Rotary.apply` plus `index_copy_`) remain the CPU path, the reference model's path and the
tests' oracle. Imported only on the GPU path: a @triton.jit kernel is bound to Triton's
interpreter, or not, when it is defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..errors import InputError

# Tokens per rotary program, from ROTARY_TILED_FROM tokens on. One token per program (8 KV groups
# x 8K tokens = 65K programs of six 64-element rows) took 115 us a layer in an 8K prefill on the
# H200, against a 57 us read/write floor; 16 tokens per program took 71 us. Decode batches keep
# one token per program: at 32 tokens, 16 per program left too few programs (3.0 vs 2.6 us).
ROTARY_TOKENS = 16
ROTARY_TILED_FROM = 1024
PDL_MAX_ROWS = 32  # add + LayerNorm launched with PDL up to this many rows (use_pdl)


def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch on this device: sm_90+, unless SPARSEGEN_NO_PDL (the one
    switch for every PDL launch and trigger of the model)."""
    return env.supports_pdl(device) and not env.flag("SPARSEGEN_NO_PDL")


def pdl_allowed(device: torch.device, rows: int, max_rows: int) -> bool:
    """`pdl_capable`, for a kernel over `rows` <= `max_rows` rows."""
    return rows <= max_rows and pdl_capable(device)


def use_pdl(x: torch.Tensor) -> bool:
    """Launch add + LayerNorm over x ([rows, N]) with programmatic dependent launch: on sm_90+, for
    up to PDL_MAX_ROWS rows, unless SPARSEGEN_NO_PDL. The kernel then waits (griddepcontrol.wait)
    for the kernel before it to finish before it reads anything, but is launched while that kernel
    still runs, which hides its launch latency.
    H200, session 6 (`benchmarks/fused/bench_pdl.py`, a cuBLAS linear then the fused kernel, graph
    replays): O projection + add/LayerNorm 15.9 -> 14.8 us at batch 1 and 16.6 -> 15.7 us at 32;
    up_proj + GeGeLU unchanged; QKV + rotary slower (19.4 -> 20.0 us), so rotary and GeGeLU launch
    plainly. Whole decode steps (`benchmarks/engine/ab_decode_step.py`, alternating engines): batch 1
    5.13 -> 5.06 ms, but batch 32 11.12 -> 11.16 ms, with every batch-32 linear on cuBLAS then.
    Session 11 (call 4, mode `norm_pdl`), with QKV, O and up_proj through `gemm_rows` (which
    triggers its dependents at its start): batch 32 10.839 / 10.867 -> 10.780 / 10.783 ms, hence
    32 rows (2 to 31 not measured separately; longer prefills launch it plainly)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return pdl_allowed(x.device, rows, PDL_MAX_ROWS)


@triton.jit
def _gegelu_kernel(X, Y, n_out, limit, BLOCK: tl.constexpr):
    # X: [rows, 2F] contiguous = n_out (gate, linear) pairs; Y: [rows, F], output i from pair i.
    # The pairs load as one contiguous run of 2 * BLOCK (vector loads), then split in registers.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    j = 2 * start + tl.arange(0, 2 * BLOCK)
    pairs = tl.load(X + j, mask=j < 2 * n_out, other=0.0).to(tl.float32)
    gate, lin = tl.split(tl.reshape(pairs, [BLOCK, 2]))  # [BLOCK] each
    i = start + tl.arange(0, BLOCK)
    ok = i < n_out
    gate = tl.minimum(gate, limit)
    lin = tl.minimum(tl.maximum(lin, -limit), limit)
    y = gate * tl.sigmoid(1.702 * gate) * (lin + 1.0)
    tl.store(Y + i, y.to(Y.dtype.element_ty), mask=ok)


def gegelu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """x: [..., 2F] -> [..., F], one kernel."""
    x = x.contiguous()
    y = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    n = y.numel()
    if n:
        _gegelu_kernel[(triton.cdiv(n, 1024),)](x, y, n, float(limit), BLOCK=1024)
    return y


# n_tokens unspecialised: Triton would build another variant for each of T == 1, T % 16 == 0 and
# other T (~0.3 s each on the H200 host the first time), and the kernel gains nothing from it.
@triton.jit(do_not_specialize=["n_tokens"])
def _rotary_qkv_kernel(
    QKV, COS, SIN, Q, K, V, KC, VC, SLOTS,
    n_tokens, stride_t, stride_c, stride_q, stride_k, stride_slot,
    page_size, stride_cp, stride_co, stride_ch,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, WRITE_CACHE: tl.constexpr,
    TRIGGER: tl.constexpr,
):  # fmt: skip
    # One program per (BLOCK_T tokens, KV group): QKV rows [G + 2, D] -> G rotated q rows, rotated
    # k, v. COS/SIN: [T, D] float32; Q: [T, HKV * G, D]; K, V: [T, HKV, D]; KC/VC: [pages,
    # page_size, HKV, D] with strides (stride_cp, stride_co, stride_ch, 1), both the same.
    if TRIGGER:  # a decode kernel launched with PDL after this one may start now (it waits itself)
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    ok = (t < n_tokens)[:, None]  # [BLOCK_T, 1]
    kv = tl.program_id(1)
    half = tl.arange(0, D // 2)[None, :]  # [1, D/2]
    full = tl.arange(0, D)[None, :]  # [1, D]
    tc = t[:, None] * stride_c
    cos_lo = tl.load(COS + tc + half, mask=ok, other=0.0)  # [BLOCK_T, D/2]
    cos_hi = tl.load(COS + tc + D // 2 + half, mask=ok, other=0.0)
    sin_lo = tl.load(SIN + tc + half, mask=ok, other=0.0)
    sin_hi = tl.load(SIN + tc + D // 2 + half, mask=ok, other=0.0)
    row = QKV + t[:, None] * stride_t + kv * (G + 2) * D  # [BLOCK_T, 1]
    if WRITE_CACHE:
        slot = tl.load(SLOTS + t * stride_slot, mask=t < n_tokens, other=0)[:, None]  # [BLOCK_T, 1]
        at = (slot // page_size) * stride_cp + (slot % page_size) * stride_co + kv * stride_ch  # [BLOCK_T, 1]
    for j in tl.static_range(G + 1):  # G queries, then k
        lo = tl.load(row + j * D + half, mask=ok, other=0.0).to(tl.float32)
        hi = tl.load(row + j * D + D // 2 + half, mask=ok, other=0.0).to(tl.float32)
        out_lo = (lo * cos_lo - hi * sin_lo).to(Q.dtype.element_ty)
        out_hi = (hi * cos_hi + lo * sin_hi).to(Q.dtype.element_ty)
        if j < G:
            dst = Q + t[:, None] * stride_q + (kv * G + j) * D
        else:
            dst = K + t[:, None] * stride_k + kv * D
        tl.store(dst + half, out_lo, mask=ok)
        tl.store(dst + D // 2 + half, out_hi, mask=ok)
        if WRITE_CACHE and j == G:
            tl.store(KC + at + half, out_lo.to(KC.dtype.element_ty), mask=ok)
            tl.store(KC + at + D // 2 + half, out_hi.to(KC.dtype.element_ty), mask=ok)
    v = tl.load(row + (G + 1) * D + full, mask=ok)
    tl.store(V + t[:, None] * stride_k + kv * D + full, v, mask=ok)
    if WRITE_CACHE:
        tl.store(VC + at + full, v, mask=ok)


def supports_rotary(qkv: torch.Tensor) -> bool:
    """The kernel wants a power-of-two head_dim and the fused QKV layout, contiguous."""
    t, hkv, g2, d = qkv.shape
    return not d & (d - 1) and qkv.stride()[1:] == (g2 * d, d, 1)


def rotary_qkv(qkv, cos, sin, cache=None, slots=None):
    """qkv: [T, Hkv, G + 2, D] (per KV group: G queries, then k, then v); cos, sin: [T, D].
    Returns q [T, Hkv * G, D] and k, v [T, Hkv, D], q and k rotated; with `cache` = (k_cache,
    v_cache), [pages, page_size, Hkv, D] with equal strides and a contiguous last dim (any page
    layout: engine.kv_cache), and `slots` [T] int64 (page * page_size + offset), writes k and v
    there."""
    t, hkv, g2, d = qkv.shape
    g = g2 - 2
    q = torch.empty((t, hkv * g, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, hkv, d), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if t == 0:
        return q, k, v
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    write = cache is not None
    if write and (cache[0].stride() != cache[1].stride() or cache[0].stride(3) != 1):
        raise InputError(
            f"the K and V caches need equal strides and a contiguous last dim, got {cache[0].stride()} "
            f"and {cache[1].stride()}"
        )
    kc, vc = cache if write else (k, v)
    cache_strides = (kc.shape[1], kc.stride(0), kc.stride(1), kc.stride(2)) if write else (1, 0, 0, 0)
    slot_ptr = slots if write else cos
    block_t = ROTARY_TOKENS if t >= ROTARY_TILED_FROM else 1
    _rotary_qkv_kernel[(triton.cdiv(t, block_t), hkv)](
        qkv, cos, sin, q, k, v, kc, vc, slot_ptr,
        t, qkv.stride(0), cos.stride(0), q.stride(0), k.stride(0), slots.stride(0) if write else 0,
        *cache_strides,
        HKV=hkv, G=g, D=d, BLOCK_T=block_t, WRITE_CACHE=write, TRIGGER=pdl_capable(qkv.device),
    )  # fmt: skip
    return q, k, v


def warm_up_rotary(k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, group: int) -> None:
    """Build the rotary kernel's two variants (one token per program, and ROTARY_TOKENS from
    ROTARY_TILED_FROM tokens on) now, writing zeros into the cache at `slot` (the engine's scratch
    page): otherwise the first prompt of >= ROTARY_TILED_FROM tokens waits for a Triton build (a
    fresh H200 machine, session 6: 645 ms for the first 8K prompt against 196 ms for the second).
    The engine's own cache is used because Triton specialises on the page size and strides."""
    _, _, hkv, d = k_cache.shape  # [pages, page_size, Hkv, D]
    dev = k_cache.device
    for t in (1, ROTARY_TILED_FROM):
        qkv = torch.zeros((t, hkv, group + 2, d), dtype=k_cache.dtype, device=dev)
        if not supports_rotary(qkv):
            return
        cos = torch.ones((t, d), dtype=torch.float32, device=dev)
        sin = torch.zeros((t, d), dtype=torch.float32, device=dev)
        slots = torch.full((t,), slot, dtype=torch.long, device=dev)  # every token into the one slot
        rotary_qkv(qkv, cos, sin, (k_cache, v_cache), slots)


@triton.jit
def _add_layer_norm_kernel(
    X, RES, W, B, Y, RES_OUT,
    stride_x, stride_res, stride_y, stride_res_out, n, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    # One program per row. X, RES: [rows, n] -> RES_OUT = X + RES (rounded to its dtype, as a plain
    # add rounds), Y = LayerNorm(RES_OUT) * W + B computed in float32 from the rounded sum.
    if TRIGGER:  # a PDL kernel after this one (gemm_rows) may launch now; it waits for this one
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:  # launched early: wait for the kernel before to finish
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(RES + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_res_out + cols, x, mask=ok)
        x = x.to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    diff = tl.where(ok, x - mean, 0.0)
    var = tl.sum(diff * diff, axis=0) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (diff * rstd * w + b).to(Y.dtype.element_ty), mask=ok)


def add_layer_norm(x, residual, weight, bias, eps: float, pdl: bool | None = None, trigger: bool = False):
    """x, residual: [T, N] (residual may be None) -> (LayerNorm(x + residual), x + residual), one
    kernel. weight, bias: [N]. The sum is rounded to x's dtype before the norm, as `x + residual`
    followed by `F.layer_norm` rounds. `trigger` (sm_90+): let a kernel launched after it with PDL
    start at once (it still waits for this one before it reads), as `models.gemm_rows` does."""
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        x = x.reshape(-1, x.shape[-1]).contiguous()
        residual = residual.reshape(-1, x.shape[-1]).contiguous() if residual is not None else None
    rows, n = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if rows:
        block = triton.next_power_of_2(n)
        warps = min(16, max(1, block // 256))
        pdl = use_pdl(x) if pdl is None else pdl
        _add_layer_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, bias, y, res_out,
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), res_out.stride(0),
            n, float(eps), HAS_RES=residual is not None, BLOCK=block, num_warps=warps, PDL=pdl, launch_pdl=pdl,
            TRIGGER=bool(trigger) and pdl_capable(x.device),
        )  # fmt: skip
    return y, res_out
