"""Writing new keys and values into the paged KV cache, as an op that torch.compile keeps whole.

Eagerly, `write_kv` is two indexed stores through the caches' strides (an fp8 cache's values
quantised first with the layer's scales, `kv_scales`) (any memory layout of the
[num_pages, page_size, Hkv, D] view: runner.kv_cache's head- or token-major pages). Under
torch.compile / torch.export it goes through the registered op `sparsegen_model::write_kv`,
which declares that it mutates the two cache tensors: traced as a plain indexed store on a graph
input, the functional graph would copy the whole cache (gigabytes) back into place every step.
"""

from __future__ import annotations

import torch

from .kv_scales import KVScales, dequantize, quantize


def _write(k_cache, v_cache, slots, k, v) -> None:
    page, offset = slot_pages(slots, k_cache.shape[1])
    k_cache[page, offset] = k
    v_cache[page, offset] = v


def slot_pages(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots [T] (page * page_size + offset) -> (page [T], offset [T]), to index a cache."""
    return torch.div(slots, page_size, rounding_mode="floor"), torch.remainder(slots, page_size)


def read_kv(cache: torch.Tensor, gather: torch.Tensor, scale: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """cache [num_pages, page_size, Hkv, D] (any strides) at gather [2, Tk] (page, offset in it)
    -> [Tk, Hkv, D] (`ForwardBatch.kv_gather`). An fp8 cache with its `scale` [Hkv] is
    dequantised to `dtype` (the model's) in the same gather, so the prefill kernel reads bf16."""
    rows = cache[gather[0], gather[1]]  # [Tk, Hkv, D]
    return rows if scale is None else dequantize(rows, scale, dtype)


@torch.library.custom_op("sparsegen_model::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [T] int64 flat slots
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    _write(k_cache, v_cache, slots, k, v)


@_write_kv_op.register_fake
def _write_kv_fake(k_cache, v_cache, slots, k, v) -> None:
    return None


def write_kv(k_cache, v_cache, slots, k, v, scales: KVScales | None = None) -> None:
    """k, v: [T, Hkv, D] into the caches at flat `slots` [T] (page * page_size + offset); into an
    fp8 cache quantised with the layer's `scales`, saturating (`kv_scales.quantize`)."""
    if scales is not None:
        k, v = quantize(k, scales.k, k_cache.dtype), quantize(v, scales.v, v_cache.dtype)
    if torch.compiler.is_compiling():
        torch.ops.sparsegen_model.write_kv(k_cache, v_cache, slots, k, v)
    else:
        _write(k_cache, v_cache, slots, k, v)
