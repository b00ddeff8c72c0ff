"""Batch-1 linear layers as a Triton GEMV: `x @ W.T + b` for one row, with what surrounds it fused.

A batch-1 decode step is the weights read once (15.6 GB for 7b). cuBLAS reads the big
matrices at ~4.0 TB/s but the two 4096-wide ones at ~3.0 TB/s, and it splits K for `dense` and
`down_proj` with a separate reduce kernel (64 extra launches per step; H200 profile, session 2).
This kernel reads W once in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N outputs (the tile
per 7b shape measured on the H200: TUNED_TILES), and adds the bias in the same pass. Fused in:
- `norm`: the residual add + LayerNorm that precedes QKV, up_proj and lm_head; each program
  computes the row's statistics itself from the 4096 inputs (16 KB with the residual, from
  cache) instead of waiting for a separate norm kernel (65 launches fewer per step);
- `gegelu_limit`: up_proj's GeGeLU over each (gate, linear) pair of outputs, so the [2F]
  intermediate never reaches memory;
- `rope` (a decode token's QKV): the rotary embedding of q and k and the K/V cache write, so
  the paged decode kernel follows the GEMV directly.
On a GPU the GEMVs launch with programmatic dependent launch, so each one's first weight tile
is read while the kernel before it ends.

On by default on a GPU (`ModelOptions.triton_gemv`, None = per device) since session 8: one
layer's four linears with their norms 125.9 us on cuBLAS -> 115.2 us, a 7b batch-1 step 4.97 ->
4.39 ms on the H200 (`benchmarks/linear/bench_gemv.py`, `benchmarks/engine/ab_decode_step.py`); session 9's
wider tiles took the step to 4.24 ms. Rounding
matches the plain path: the fp32 sum plus bias is rounded to the output dtype, and GeGeLU and
the rotary read those rounded values, as `gegelu(linear(x))` and `fused.rotary_qkv` do. Runs
in Triton's interpreter (fp16/fp32) for the CPU tests. Imported only where it is used: a
@triton.jit kernel is bound to the interpreter, or not, when it is defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError
from .fused import pdl_capable
from .rope import RopeWrite  # noqa: F401 - part of this module's interface: gemv(..., rope=RopeWrite(...))

TILE_ELEMS = 4096  # elements of W per program and iteration (8 KB of bf16), untuned shapes
PROGRAMS_PER_SM = 8
# The fastest tile of each 7b shape on an H200 (session 8, `benchmarks/linear/bench_gemv.py --sweep`:
# one row, CUDA-graph replays over weight copies far above the L2; dense, up_proj, down_proj and
# lm_head from the wider sweeps of GEMVs chained by PDL of session 8's call 9 and session 9's
# call 6, adopted in session 9 after engine A/Bs):
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
GEMV_PDL = True  # launch with programmatic dependent launch where fused.pdl_capable (see the kernel)


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
    COS, SIN, KC, VC, SLOT, page_size, stride_cp, stride_co, stride_ch,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, GEGELU: tl.constexpr, NORM: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    ROW_SUM: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr, HEAD_D: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    # K is a constexpr: a model has two (hidden and intermediate size), and a known trip count
    # lets the loop be unrolled (and Triton's interpreter cannot loop to a runtime int); KP is
    # the next power of two >= K.
    # X: [K]; W: [N, K] rows with stride stride_w, contiguous along K; B: [N]; Y: [N], or [N // 2]
    # with GEGELU (output i from W rows 2i (gate) and 2i + 1 (linear)). One program: BLOCK_N
    # outputs (BLOCK_N pairs of rows with GEGELU or ROPE).
    # ROPE (Phi-3-Small's QKV for one decode token): the N = Hkv * (G + 2) * HEAD_D rows are
    # HEAD_D-row slots, per KV head G queries, then k, then v; pair i of a slot is its rows i and
    # i + HEAD_D / 2, rotated together by COS/SIN [HEAD_D] (float32) at i and i + HEAD_D / 2, as
    # fused.rotary_qkv does (v is not rotated). The queries go to Y [Hkv * G * HEAD_D]; k and v
    # go to the caches KC/VC at the flat slot SLOT[0] (page = slot // page_size), strides
    # (stride_cp, stride_co, stride_ch, 1), and nowhere else.
    # NORM: the input is LayerNorm(X + RES) * LNW + LNB (RES only with HAS_RES), each program
    # computing the row's mean and variance itself from the whole row, loaded at once (from
    # cache); program 0 also writes X + RES to RES_OUT. Rounded where add + F.layer_norm round.
    # PREFETCH: the next W tile is loaded before the current one is used (two tiles in flight
    # per program), and the first one before the norm's statistics, which do not need it.
    # ROW_SUM: the products are summed over each tile as it comes (a [BLOCK_N] sum, fewer
    # registers) instead of into a [BLOCK_N, BLOCK_K] sum reduced once at the end.
    # PDL (launched with programmatic dependent launch): every program lets the next kernel
    # launch at once (it waits for this one to finish before it reads), and waits for the
    # kernel before it only after its first W tile is on its way (weights are never written),
    # so that tile's latency overlaps the previous kernel's tail.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    PAIRED: tl.constexpr = GEGELU or ROPE  # each output reads two weight rows (r_a, r_b)
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output index
    ks = tl.arange(0, BLOCK_K)
    if GEGELU:
        n_out = N // 2
        r_a = 2 * rows  # gate rows
        r_b = 2 * rows + 1  # linear rows
    elif ROPE:
        n_out = N // 2
        hs = rows // (HEAD_D // 2)  # the pair's slot (KV head * (G + 2) + j)
        r_a = hs * HEAD_D + rows % (HEAD_D // 2)  # lower half
        r_b = r_a + HEAD_D // 2  # upper half
    else:
        n_out = N
        r_a = rows
        r_b = rows
    ok = rows < n_out
    p_a = W + r_a[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K] pointers of the first tile
    p_b = W + r_b[:, None] * stride_w + ks[None, :]
    if PREFETCH:
        m0 = ok[:, None] & (ks < K)[None, :]
        w_a = tl.load(p_a, mask=m0, other=0.0)
        w_b = w_a
        if PAIRED:
            w_b = tl.load(p_b, mask=m0, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # X and RES are the previous kernel's outputs
    mean = 0.0
    rstd = 1.0
    if NORM:
        kall = tl.arange(0, KP)
        kall_ok = kall < K
        s_all = _summed(X, RES, kall, kall_ok, HAS_RES)  # [KP], the whole row at once
        if HAS_RES:
            if pid == 0:
                tl.store(RES_OUT + kall, s_all.to(RES_OUT.dtype.element_ty), mask=kall_ok)
        mean = tl.sum(s_all, axis=0) / K
        d = tl.where(kall_ok, s_all - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / K + eps)
    if ROW_SUM:
        acc_a = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
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
        if PREFETCH:
            cur_a = w_a
            cur_b = w_b
            m_next = ok[:, None] & (kk + BLOCK_K < K)[None, :]  # all false after the last tile
            w_a = tl.load(p_a + k0 + BLOCK_K, mask=m_next, other=0.0)
            if PAIRED:
                w_b = tl.load(p_b + k0 + BLOCK_K, mask=m_next, other=0.0)
        else:
            m = ok[:, None] & k_ok[None, :]
            cur_a = tl.load(p_a + k0, mask=m, other=0.0)
            cur_b = cur_a
            if PAIRED:
                cur_b = tl.load(p_b + k0, mask=m, other=0.0)
        if ROW_SUM:
            acc_a += tl.sum(cur_a.to(tl.float32) * x, axis=1)
            if PAIRED:
                acc_b += tl.sum(cur_b.to(tl.float32) * x, axis=1)
        else:
            acc_a += cur_a.to(tl.float32) * x
            if PAIRED:
                acc_b += cur_b.to(tl.float32) * x
    if ROW_SUM:
        y_a = acc_a
        y_b = acc_b
    else:
        y_a = tl.sum(acc_a, axis=1)
        y_b = tl.sum(acc_b, axis=1)
    if HAS_BIAS:
        y_a += tl.load(B + r_a, mask=ok, other=0.0).to(tl.float32)
    y_a = y_a.to(Y.dtype.element_ty)  # where the plain linear rounds
    if PAIRED:
        if HAS_BIAS:
            y_b += tl.load(B + r_b, mask=ok, other=0.0).to(tl.float32)
        y_b = y_b.to(Y.dtype.element_ty)
    if GEGELU:
        gate = tl.minimum(y_a.to(tl.float32), limit)
        lin = tl.minimum(tl.maximum(y_b.to(tl.float32), -limit), limit)
        out = (gate * tl.sigmoid(1.702 * gate) * (lin + 1.0)).to(Y.dtype.element_ty)
        tl.store(Y + rows, out, mask=ok)
    elif ROPE:
        i = rows % (HEAD_D // 2)
        kv = hs // (G + 2)
        j = hs % (G + 2)  # < G: a query, G: k, G + 1: v
        lo = y_a.to(tl.float32)
        hi = y_b.to(tl.float32)
        cos_lo = tl.load(COS + i, mask=ok, other=0.0)
        cos_hi = tl.load(COS + i + HEAD_D // 2, mask=ok, other=0.0)
        sin_lo = tl.load(SIN + i, mask=ok, other=0.0)
        sin_hi = tl.load(SIN + i + HEAD_D // 2, mask=ok, other=0.0)
        rot = j <= G
        out_lo = tl.where(rot, lo * cos_lo - hi * sin_lo, lo).to(Y.dtype.element_ty)
        out_hi = tl.where(rot, hi * cos_hi + lo * sin_hi, hi).to(Y.dtype.element_ty)
        q_at = (kv * G + j) * HEAD_D + i
        is_q = ok & (j < G)
        tl.store(Y + q_at, out_lo, mask=is_q)
        tl.store(Y + q_at + HEAD_D // 2, out_hi, mask=is_q)
        slot = tl.load(SLOT)
        at = (slot // page_size) * stride_cp + (slot % page_size) * stride_co + kv * stride_ch + i
        is_k = ok & (j == G)
        tl.store(KC + at, out_lo.to(KC.dtype.element_ty), mask=is_k)
        tl.store(KC + at + HEAD_D // 2, out_hi.to(KC.dtype.element_ty), mask=is_k)
        is_v = ok & (j == G + 1)
        tl.store(VC + at, out_lo.to(VC.dtype.element_ty), mask=is_v)
        tl.store(VC + at + HEAD_D // 2, out_hi.to(VC.dtype.element_ty), mask=is_v)
    else:
        tl.store(Y + rows, y_a, mask=ok)


def tile_for(n: int, k: int, mode: str, norm: bool, device: torch.device) -> tuple:
    """(block_n, block_k, num_warps, prefetch, row_sum) for weight rows n: TUNED_TILES on a GPU
    where the shape is there; else block_n from block_n_for, TILE_ELEMS of W per iteration, 4
    warps, prefetch on (session 8's sweep: without it the LayerNorm + up_proj + GeGeLU GEMV took
    89.9 us instead of 60.9 with the same tile), per-tile row sums off."""
    tuned = TUNED_TILES.get((n, k, mode, norm)) if device.type == "cuda" else None
    if tuned is not None:
        return tuned
    n_out = n if mode == "plain" else n // 2
    block_n = block_n_for(n_out, PROGRAMS_PER_SM * _sm_count(device))
    return block_n, _block_k(block_n, k, mode), 4, True, False


def _block_k(block_n: int, k: int, mode: str) -> int:
    rows_read = block_n if mode == "plain" else 2 * block_n  # both row sets of a paired program
    return min(triton.next_power_of_2(k), max(16, TILE_ELEMS // rows_read))


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
    rope: RopeWrite | None = None,
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
    [1, Hkv * G * D], k and v written into the caches only. With `norm`, the input is first
    `layer_norm(x + residual)` (x alone when residual is None), as `layers.add_norm` computes it,
    and the call returns `(y, x + residual)` (`(y, x)` without a residual). block_n / block_k /
    num_warps override the heuristic or TUNED_TILES, and prefetch / row_sum / pdl pick the
    kernel's variants (benchmarks; see the kernel; pdl defaults to GEMV_PDL where
    `fused.pdl_capable`)."""
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
    if gegelu_limit is not None and rope is not None:
        raise InputError("gemv takes gegelu_limit or rope, not both")
    mode = "gegelu" if gegelu_limit is not None else "rope" if rope is not None else "plain"
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
    if n_out:
        tile = tile_for(n, k, mode, norm is not None, x.device)
        if block_n is not None or block_k is not None:  # an explicit tile keeps the given warps
            bn = block_n or tile[0]
            tile = (bn, block_k or _block_k(bn, k, mode), num_warps, *tile[3:])
        block_n, block_k, num_warps, t_prefetch, t_row_sum = tile
        prefetch = t_prefetch if prefetch is None else prefetch
        row_sum = t_row_sum if row_sum is None else row_sum
        if pdl is None:
            pdl = GEMV_PDL and x.is_cuda and pdl_capable(x.device)
        _gemv_kernel[(triton.cdiv(n_out, block_n),)](
            x, weight, bias if bias is not None else dummy, y, n, weight.stride(0),
            float(gegelu_limit) if gegelu_limit is not None else 0.0,
            res if res is not None else dummy, lnw if lnw is not None else dummy,
            lnb if lnb is not None else dummy, res_out, float(eps),
            cos, sin, kc, vc, slot, *cache_strides,
            K=k, KP=triton.next_power_of_2(k), HAS_BIAS=bias is not None, GEGELU=mode == "gegelu",
            NORM=norm is not None, HAS_RES=res is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            PREFETCH=bool(prefetch), ROW_SUM=bool(row_sum), PDL=bool(pdl), ROPE=mode == "rope",
            HEAD_D=head_d, G=group, num_warps=num_warps, launch_pdl=bool(pdl),
        )  # fmt: skip
    elif res is not None:
        res_out.copy_(x + res)
    if norm is None:
        return y
    return y, res_out[None, :]
