"""Argument checks shared by the reference and every kernel family: one policy, one place.

Every check raises `InputError` naming the argument and what is wrong, before any work is
launched. Checks that need to read tensor *values* (cu_seqlens, seq_lens, page ids) are the
only ones that synchronise with the device; callers that know their values are right skip them
(`check=False`, or prefill's `max_seqlen_q` / `max_seqlen_k`).

Alignment policy, the same for prefill and decode (`check_alignment`): a kernel's float tensors
need a contiguous last dim, a 16-byte-aligned base address and every other stride a multiple of
16 elements. Prefill's kernels are compiled with those divisibility hints; decode's loads
assume them. A tensor that breaks it is an InputError naming it (call `.contiguous()`), never a
silent copy.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import dtypes
from .errors import InputError
from .spec import FP32_MAX, FP32_MIN_NORMAL, LOG2E, MAX_SCALE, MAX_SEQ_LEN, MIN_SCALE, LayerSpec

__all__ = ["FP32_MAX", "FP32_MIN_NORMAL", "LOG2E", "MAX_SCALE", "MIN_SCALE"]  # re-exported bounds

KERNEL_DTYPES = dtypes.KERNEL_DTYPES
REFERENCE_DTYPES = dtypes.REFERENCE_DTYPES
ALIGN_BYTES = 16
ALIGN_STRIDE = 16  # elements


def layer_scale(scale: object, layer: LayerSpec) -> float:
    """The call's score scale: `scale` when given, else the layer's default (`LayerSpec.scale`,
    else 1/sqrt(head_dim)); checked as `softmax_scale` checks it."""
    return softmax_scale(layer.default_scale if scale is None else scale, layer.head_dim)


def softmax_scale(scale: object, head_dim: int) -> float:
    """The score scale: 1/sqrt(head_dim) by default; else a real number (int or float, not bool,
    not a string, not a tensor) in [MIN_SCALE, MAX_SCALE]: > 0 because the kernels fold it into
    the running max, and bounded so that scale * log2(e) is a finite, normal fp32."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InputError(f"scale must be a float or an int (or None), got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except OverflowError:  # an int beyond any float
        value = math.inf
    if not math.isfinite(value) or not (MIN_SCALE <= value <= MAX_SCALE):
        raise InputError(
            f"scale must be a finite number in [{MIN_SCALE:.3g}, {MAX_SCALE:.3g}] (scale * log2(e) must be a "
            f"normal fp32), got {value!r}"
        )
    return value


def check_bool(name: str, value: object) -> bool:
    """An exact bool (not 0 / 1 or a string); the error names the argument."""
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}")
    return value


def check_alignment(name: str, t: torch.Tensor) -> None:
    """The alignment policy of every kernel launch (see the module docstring)."""
    if t.dim() and t.stride(-1) != 1:
        raise InputError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")
    if any(s % ALIGN_STRIDE for s in t.stride()[:-1]) or t.data_ptr() % ALIGN_BYTES:
        raise InputError(
            f"{name} must be {ALIGN_BYTES}-byte aligned with strides that are multiples of {ALIGN_STRIDE} "
            f"elements, got strides {t.stride()} and address {t.data_ptr():#x}; pass {name}.contiguous()"
        )


def _check_storage(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    for n, t in zip(names, tensors):
        if t.device.type == "meta":
            raise InputError(f"{n} is a meta tensor (it has no data); pass a tensor on a CPU or CUDA device")
        if t.is_sparse or t.layout != torch.strided:
            raise InputError(f"{n} must be a dense strided tensor, got layout {t.layout}")
        if t.is_complex() or t.is_quantized:
            raise InputError(f"{n} has dtype {t.dtype}; sparsegen takes real float / int32 tensors")


def _check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise InputError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    return t


def _check_layer(layer: object) -> LayerSpec:
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
    return layer


def _check_float_dtypes(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], allowed) -> None:
    dt = tensors[0].dtype
    if dt not in allowed:
        raise InputError(f"{names[0]} has dtype {dt}; supported: {', '.join(map(str, allowed))}")
    for n, t in zip(names[1:], tensors[1:]):
        if t.dtype != dt:
            raise InputError(f"{n} has dtype {t.dtype} but {names[0]} has {dt}")


def _check_qkv_dtypes(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], allowed) -> None:
    """q in `allowed`; k and v of q's dtype, or both of one fp8 dtype (an fp8 KV cache)."""
    q, k, v = tensors
    if k.dtype in dtypes.FP8_DTYPES or v.dtype in dtypes.FP8_DTYPES:
        _check_float_dtypes(names[:1], (q,), allowed)
        if k.dtype != v.dtype:
            raise InputError(f"{names[2]} has dtype {v.dtype} but {names[1]} has {k.dtype}")
        return
    _check_float_dtypes(names, tensors, allowed)


def check_features(layer: LayerSpec, q: torch.Tensor, kv_dtype: torch.dtype, *, sinks=None, k_scale=None,
                   v_scale=None, values: bool = True) -> None:  # fmt: skip
    """The per-call feature tensors: `sinks` ([H] float32, finite) exactly when the layer has
    learned sinks; `k_scale` and `v_scale` (float32, [Hkv] or [], finite and > 0) exactly when
    the KV dtype is fp8. All on q's device. `values` also reads them (a device sync)."""
    if layer.learned_sinks and sinks is None:
        raise InputError(
            "this layer has learned_sinks=True: pass sinks=, a float32 tensor [H] of one logit per head"
        )
    if not layer.learned_sinks and sinks is not None:
        raise InputError("sinks= was passed, but the layer has learned_sinks=False (set it in the LayerSpec)")
    if sinks is not None:
        _check_feature_tensor("sinks", sinks, q, ((layer.num_heads,),))
        if values and not bool(torch.isfinite(sinks).all()):
            raise InputError("sinks must be finite (a head with no sink is not a learned-sinks head)")
    fp8 = kv_dtype in dtypes.FP8_DTYPES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if fp8 and scale is None:
            raise InputError(f"the KV tensors are {kv_dtype}: pass {name}=, float32 of shape [Hkv] or []")
        if not fp8 and scale is not None:
            raise InputError(f"{name}= is only for fp8 K/V, but they are {kv_dtype}")
        if scale is not None:
            _check_feature_tensor(name, scale, q, ((layer.num_kv_heads,), ()))
            if values and not bool(((scale > 0) & torch.isfinite(scale)).all()):
                raise InputError(f"{name} must be finite and > 0")


def _check_feature_tensor(name: str, t: object, q: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_storage((name,), (t,))
    if t.dtype != torch.float32:
        raise InputError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise InputError(
            f"{name} must have shape {' or '.join(map(str, map(list, shapes)))}, got {list(t.shape)}"
        )
    if t.device != q.device:
        raise InputError(f"{name} is on {t.device} but q is on {q.device}")
    if t.dim() and t.stride(0) != 1:
        raise InputError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_same_device(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    dev = tensors[0].device
    for n, t in zip(names[1:], tensors[1:]):
        if t.device != dev:
            raise InputError(f"{n} is on {t.device} but {names[0]} is on {dev}")


def _check_int32_vector(name: str, t: object, length: int | None = None) -> torch.Tensor:
    t = _check_tensor(name, t, 1)
    if t.dtype != torch.int32:
        raise InputError(f"{name} must be int32, got {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise InputError(f"{name} must have {length} entries, got {t.shape[0]}")
    return t


def _check_max_seqlen(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"{name} must be a non-negative int (or None), got {value!r}")
    return int(value)


def check_cu_seqlens(cu_q, cu_k, total_q: int, total_k: int, *, check_values: bool = True,
                     max_seqlen_q=None, max_seqlen_k=None) -> None:  # fmt: skip
    """Offsets are int32 [B+1] on one device; with `check_values` (one device->host copy) they
    start at 0, never decrease, end at the totals, q_len <= k_len per sequence, and the given
    max_seqlen_* bound every length."""
    _check_int32_vector("cu_seqlens_q", cu_q)
    _check_int32_vector("cu_seqlens_k", cu_k)
    _check_storage(("cu_seqlens_q", "cu_seqlens_k"), (cu_q, cu_k))
    if cu_q.device != cu_k.device:
        raise InputError(f"cu_seqlens_k is on {cu_k.device} but cu_seqlens_q is on {cu_q.device}")
    if cu_q.shape[0] < 2 or cu_q.shape != cu_k.shape:
        raise InputError(
            f"cu_seqlens_q and cu_seqlens_k must both be [B+1] with B >= 1, got "
            f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}"
        )
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if max_k is not None and max_k > MAX_SEQ_LEN:
        raise InputError(f"max_seqlen_k is {max_k}; at most {MAX_SEQ_LEN} tokens per sequence")
    if check_values:
        check_cu_seqlens_values(cu_q, cu_k, total_q, total_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def check_cu_seqlens_values(cu_q, cu_k, total_q: int, total_k: int, *, max_seqlen_q=None,
                            max_seqlen_k=None) -> None:  # fmt: skip
    """The value half of `check_cu_seqlens` (the only part that synchronises with the device);
    the caller ran the structural half first."""
    max_q, max_k = max_seqlen_q, max_seqlen_k
    both = torch.cat([cu_q, cu_k]).tolist()  # one device->host copy for both
    n = cu_q.shape[0]
    vals_q, vals_k = both[:n], both[n:]
    for name, vals, total in (("cu_seqlens_q", vals_q, total_q), ("cu_seqlens_k", vals_k, total_k)):
        if vals[0] != 0:
            raise InputError(f"{name}[0] must be 0, got {vals[0]}")
        if vals[-1] != total:
            raise InputError(f"{name}[-1] is {vals[-1]} but the tensor has {total} tokens")
        if any(b < a for a, b in zip(vals, vals[1:])):
            raise InputError(f"{name} must be non-decreasing, got {vals}")
    for b in range(n - 1):
        lq, lk = vals_q[b + 1] - vals_q[b], vals_k[b + 1] - vals_k[b]
        if lq > lk:
            raise InputError(f"sequence {b} has q_len {lq} > k_len {lk}; queries must be the last keys")
        if max_q is not None and lq > max_q:
            raise InputError(f"sequence {b} has q_len {lq} > max_seqlen_q {max_q}")
        if max_k is not None and lk > max_k:
            raise InputError(f"sequence {b} has k_len {lk} > max_seqlen_k {max_k}")
        if lk > MAX_SEQ_LEN:  # specs are normalised up to this length only (sparsegen.spec)
            raise InputError(f"sequence {b} has k_len {lk}; at most {MAX_SEQ_LEN} tokens per sequence")


def check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, *, allow_cpu: bool, kernel: bool = False,
                         check_values: bool = True, max_seqlen_q=None, max_seqlen_k=None, sinks=None,
                         k_scale=None, v_scale=None) -> None:  # fmt: skip
    """Everything about prefill's arguments (`check_features` for the feature tensors);
    `kernel=True` adds the alignment policy."""
    layer = _check_layer(layer)
    q = _check_tensor("q", q, 3)
    k = _check_tensor("k", k, 3)
    v = _check_tensor("v", v, 3)
    _check_storage(("q", "k", "v"), (q, k, v))
    _check_qkv_dtypes(("q", "k", "v"), (q, k, v), REFERENCE_DTYPES if allow_cpu else KERNEL_DTYPES)
    _check_same_device(("q", "k", "v"), (q, k, v))
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if q.shape[1:] != (h, d):
        raise InputError(f"q must be [Tq, {h}, {d}] for this layer, got {tuple(q.shape)}")
    if k.shape[1:] != (hkv, d):
        raise InputError(f"k must be [Tk, {hkv}, {d}] for this layer, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise InputError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], check_values=check_values,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)  # fmt: skip
    if cu_seqlens_q.device != q.device:
        raise InputError(f"cu_seqlens_q is on {cu_seqlens_q.device} but q is on {q.device}")
    check_features(layer, q, k.dtype, sinks=sinks, k_scale=k_scale, v_scale=v_scale, values=check_values)
    if kernel:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_alignment(name, t)


def check_decode_inputs(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    layer,
    *,
    allow_cpu: bool,
    check_pages: bool,
    kernel: bool = False,
    sinks=None,
    k_scale=None,
    v_scale=None,
) -> None:
    """Everything about paged decode's arguments (`check_features` for the feature tensors);
    `kernel=True` adds the alignment policy."""
    layer = _check_layer(layer)
    q = _check_tensor("q", q, 3)
    k_cache = _check_tensor("k_cache", k_cache, 4)
    v_cache = _check_tensor("v_cache", v_cache, 4)
    _check_storage(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    _check_qkv_dtypes(
        ("q", "k_cache", "v_cache"), (q, k_cache, v_cache), REFERENCE_DTYPES if allow_cpu else KERNEL_DTYPES
    )
    batch = q.shape[0]
    block_tables = _check_tensor("block_tables", block_tables, 2)
    if block_tables.dtype != torch.int32:
        raise InputError(f"block_tables must be int32, got {block_tables.dtype}")
    seq_lens = _check_int32_vector("seq_lens", seq_lens, batch)
    _check_storage(("block_tables", "seq_lens"), (block_tables, seq_lens))
    _check_same_device(
        ("q", "k_cache", "v_cache", "block_tables", "seq_lens"),
        (q, k_cache, v_cache, block_tables, seq_lens),
    )
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if q.shape[1:] != (h, d):
        raise InputError(f"q must be [B, {h}, {d}] for this layer, got {tuple(q.shape)}")
    if k_cache.shape[2:] != (hkv, d):
        raise InputError(
            f"k_cache must be [num_pages, page_size, {hkv}, {d}] for this layer, got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise InputError(
            f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"
        )
    if block_tables.shape[0] != batch:
        raise InputError(f"block_tables must have {batch} rows (one per query), got {block_tables.shape[0]}")
    if batch == 0:
        raise InputError("q has batch size 0")
    check_features(layer, q, k_cache.dtype, sinks=sinks, k_scale=k_scale, v_scale=v_scale, values=check_pages)
    if kernel:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_alignment(name, t)
        if block_tables.stride(1) != 1:
            raise InputError(
                f"block_tables must be contiguous in its last dim, got strides {block_tables.stride()}"
            )
        if seq_lens.stride(0) != 1:
            raise InputError(f"seq_lens must be contiguous, got stride {seq_lens.stride()}")
    if check_pages:
        check_page_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])


def check_page_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int
) -> None:
    """seq_lens fit their tables, and every page a sequence uses is a valid page id."""
    max_pages = block_tables.shape[1]
    lens = seq_lens.cpu()
    bad = ((lens < 1) | (lens > max_pages * page_size)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise InputError(
            f"seq_lens[{b}] = {int(lens[b])} must be in 1..{max_pages * page_size} "
            f"(block_tables has {max_pages} pages of {page_size} tokens)"
        )
    used = torch.arange(max_pages) < ((lens + page_size - 1) // page_size).unsqueeze(1)
    tables = block_tables.cpu()
    out_of_range = used & ((tables < 0) | (tables >= num_pages))
    if out_of_range.any():
        b, p = (int(x) for x in out_of_range.nonzero()[0])
        raise InputError(
            f"block_tables[{b}, {p}] = {int(tables[b, p])} is not a page id in 0..{num_pages - 1}"
        )
