"""Phi-3-Small's rotary embedding of a fused QKV projection, with the K/V cache write, as one
Triton kernel (templates/rotary_kv_write.py.jinja).

    q, k, v = rotary_qkv(qkv, cos, sin, (k_cache, v_cache), slots)   # qkv: [T, Hkv, G + 2, D]

Per KV group the projection holds G queries, then k, then v; the kernel rotates q and k in
float32 (NeoX style over the whole head), rounds where `models.rope.Rotary.apply` rounds,
splits the three apart and writes k and v into the paged caches at each token's slot. An fp8
cache takes the layer's scales (`scales=`: models.kv_scales.KVScales, or anything with `k` / `v`
float32 [Hkv]) and gets k / k_scale and v / v_scale, saturated, as `kv_scales.quantize` writes
them. The plain path (`Rotary.apply` plus `write_kv`) is the CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch

from ...dtypes import FP8_DTYPES
from ...errors import InputError
from ..families.model_triton import ROTARY
from ..launch_target import Target, target_of
from ..triton_kernel import TritonLauncher

# Tokens per rotary program, from ROTARY_TILED_FROM tokens on. One token per program (8 KV groups
# x 8K tokens = 65K programs of six 64-element rows) took 115 us a layer in an 8K prefill on the
# H200, against a 57 us read/write floor; 16 tokens per program took 71 us. Decode batches keep
# one token per program: at 32 tokens, 16 per program left too few programs (3.0 vs 2.6 us).
ROTARY_TOKENS = 16
ROTARY_TILED_FROM = 1024


LAUNCH = TritonLauncher(ROTARY)


def supports_rotary(qkv: torch.Tensor) -> bool:
    """The kernel wants a power-of-two head_dim and the fused QKV layout, contiguous."""
    t, hkv, g2, d = qkv.shape
    return not d & (d - 1) and qkv.stride()[1:] == (g2 * d, d, 1)


def rotary_qkv(qkv, cos, sin, cache=None, slots=None, scales=None):
    """qkv: [T, Hkv, G + 2, D] (per KV group: G queries, then k, then v); cos, sin: [T, D].
    Returns q [T, Hkv * G, D] and k, v [T, Hkv, D], q and k rotated; with `cache` = (k_cache,
    v_cache), [pages, page_size, Hkv, D] with equal strides and a contiguous last dim (any page
    layout: runner.kv_cache), and `slots` [T] int64 (page * page_size + offset), writes k and v
    there (an fp8 cache: quantised with `scales`)."""
    q, k, v, launch = _plan(qkv, cos, sin, cache, slots, target_of(qkv.device), scales)
    if launch is not None:
        LAUNCH(*launch)
    return q, k, v


def request(qkv, cos, sin, cache=None, slots=None, *, target: Target, arch: str, scales=None):
    """The request a `rotary_qkv(...)` launch makes on a GPU of `arch` described by `target`
    (tensors may be on the meta device); None for no tokens."""
    launch = _plan(qkv, cos, sin, cache, slots, target, scales)[3]
    return None if launch is None else LAUNCH.request(*launch[1:], arch)


def _fp8_scales(cache, scales, hkv: int, device) -> tuple:
    """(KS, VS, FP8_MAX) for the launch: the scales of an fp8 cache, checked; placeholders and 0.0
    for a cache of q's dtype (or none), which must come without scales."""
    fp8 = cache is not None and cache[0].dtype in FP8_DTYPES
    if not fp8:
        if scales is not None:
            raise InputError("scales= is only for an fp8 KV cache")
        return None, None, 0.0
    if cache[1].dtype != cache[0].dtype:
        raise InputError(
            f"the K and V caches must share one fp8 dtype, got {cache[0].dtype} and {cache[1].dtype}"
        )
    if scales is None:
        raise InputError(f"an {cache[0].dtype} KV cache needs scales= (k and v, float32 [{hkv}])")
    for name in ("k", "v"):
        s = getattr(scales, name, None)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (hkv,):
            raise InputError(f"scales.{name} must be a float32 tensor [{hkv}], got {s!r:.80}")
        if s.device != device or s.stride(0) != 1:
            raise InputError(
                f"scales.{name} must be contiguous on {device}, got {s.device}, stride {s.stride()}"
            )
    return scales.k, scales.v, float(torch.finfo(cache[0].dtype).max)


def _plan(qkv, cos, sin, cache, slots, target: Target, scales=None):
    """The outputs and the launch (grid, args, constexprs, options, dtype), or None for no tokens."""
    t, hkv, g2, d = qkv.shape
    g = g2 - 2
    q = torch.empty((t, hkv * g, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, hkv, d), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if t == 0:
        return q, k, v, None
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    write = cache is not None
    if write and (cache[0].stride() != cache[1].stride() or cache[0].stride(3) != 1):
        raise InputError(
            f"the K and V caches need equal strides and a contiguous last dim, got {cache[0].stride()} "
            f"and {cache[1].stride()}"
        )
    kc, vc = (cache[0], cache[1]) if write else (k, v)  # a (k, v) pair or a KVLayer (k, v, scales)
    cache_strides = (kc.shape[1], kc.stride(0), kc.stride(1), kc.stride(2)) if write else (1, 0, 0, 0)
    slot_ptr = slots if write else cos
    ks, vs, fp8_max = _fp8_scales(cache, scales, hkv, qkv.device)
    block_t = ROTARY_TOKENS if t >= ROTARY_TILED_FROM else 1
    args = (
        qkv, cos, sin, q, k, v, kc, vc, slot_ptr,
        t, qkv.stride(0), cos.stride(0), q.stride(0), k.stride(0), slots.stride(0) if write else 0,
        *cache_strides, cos if ks is None else ks, cos if vs is None else vs,  # KS, VS: unused without fp8
    )  # fmt: skip
    constexprs = (hkv, g, d, block_t, write, target.pdl, fp8_max)
    return q, k, v, ((-(-t // block_t), hkv, 1), args, constexprs, (), qkv.dtype)


def warm_up_rotary(k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, group: int, scales=None,
                   dtype: torch.dtype | None = None) -> None:  # fmt: skip
    """Load (or build) the rotary kernel's two variants (one token per program, and ROTARY_TOKENS
    from ROTARY_TILED_FROM tokens on) now, by launching both, writing zeros into the cache at
    `slot` (the engine's scratch page): otherwise the first prompt of >= ROTARY_TILED_FROM tokens
    waits for it (on a fresh H200 machine, 645 ms for the first 8K prompt against 196 ms for the
    second). The engine's own cache is used because the kernel is specialised on the page size
    and strides; an fp8 cache's warm-up takes its layer's `scales` and the model's `dtype`."""
    _, _, hkv, d = k_cache.shape  # [pages, page_size, Hkv, D]
    dev = k_cache.device
    for t in (1, ROTARY_TILED_FROM):
        qkv = torch.zeros((t, hkv, group + 2, d), dtype=dtype or k_cache.dtype, device=dev)
        if not supports_rotary(qkv):
            return
        cos = torch.ones((t, d), dtype=torch.float32, device=dev)
        sin = torch.zeros((t, d), dtype=torch.float32, device=dev)
        slots = torch.full((t,), slot, dtype=torch.long, device=dev)  # every token into the one slot
        rotary_qkv(qkv, cos, sin, (k_cache, v_cache), slots, scales)
