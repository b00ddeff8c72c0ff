"""The paged decode kernel through the lifecycle: the getter and `sparsegen.paged_decode`'s
entry, above `kernels.base`.

    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16)   # compiled + cached
    out = launch_checked(q, k_cache, v_cache, block_tables, seq_lens, layer, scale)   # [B, H, D]
    fp8 = get_decode_kernel(layer, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)   # fp8 caches

The family (template, NVRTC build, launch, split heuristic) is `families.decode`.
"""

from __future__ import annotations

import torch

from ..spec import LayerSpec
from ..validate import check_decode_inputs, layer_scale
from . import base
from .families.decode import (
    BLOCKS_PER_SM,
    DEFAULT_KNOBS,
    MAX_CONTEXT,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    PAGE_SIZES,
    TILE,
    CudaDecode,
    DecodeKernel,
    cache_kv_dtype,
    check_kernel_inputs,
    launch_matching,
    num_splits,
)

forget = base.forget


def get_decode_kernel(
    layer: LayerSpec,
    *,
    dtype,
    arch: str | None = None,
    page_size: int = 16,
    knobs: dict | None = None,
    kv_dtype=None,
) -> DecodeKernel:
    """The compiled kernel for this layer, dtype, page size and arch (default: this GPU's);
    `knobs` (benchmarks, tests) sets template knobs (decode_template.DEFAULT_KNOBS) and is part
    of the request, so such a kernel is cached like the default one. `kv_dtype` (None: q's
    dtype; torch.float8_e4m3fn / float8_e5m2 or their names) is the cache's element type."""
    return base.get(
        "decode", layer, dtype=dtype, arch=arch, page_size=page_size, knobs=knobs, kv_dtype=kv_dtype
    )


def launch_checked(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    layer,
    scale: float,
    *,
    kernel=None,
    pdl=False,
    sinks=None,
    k_scale=None,
    v_scale=None,
):
    """Inputs already passed validate.check_decode_inputs(kernel=True): this kernel's own limits,
    fetch the kernel (an fp8 one for an fp8 cache), launch on the current stream. Returns [B, H, D]."""
    check_kernel_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if kernel is None:
        kernel = get_decode_kernel(layer, dtype=q.dtype, page_size=k_cache.shape[1],
                                   kv_dtype=cache_kv_dtype(k_cache) or None)  # fmt: skip
        return kernel.launch(q, k_cache, v_cache, block_tables, seq_lens, scale, pdl=pdl, sinks=sinks,
                             k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    return launch_matching(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale, pdl=pdl, sinks=sinks,
                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip


def cuda_paged_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    layer,
    scale=None,
    *,
    check: bool = False,
    kernel=None,
    pdl=False,
    sinks=None,
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Validate, fetch the compiled kernel, launch on the current stream. Returns [B, H, D]."""
    check_decode_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        layer,
        allow_cpu=False,
        check_pages=check,
        kernel=True,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return launch_checked(q, k_cache, v_cache, block_tables, seq_lens, layer, layer_scale(scale, layer),
                          kernel=kernel, pdl=pdl, sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip


__all__ = [
    "BLOCKS_PER_SM", "DEFAULT_KNOBS", "MAX_CONTEXT", "MAX_SPLITS", "MIN_SPLIT_TOKENS", "PAGE_SIZES", "TILE",
    "CudaDecode", "DecodeKernel", "cache_kv_dtype", "check_kernel_inputs", "cuda_paged_decode", "forget", "get_decode_kernel",
    "launch_checked", "launch_matching", "num_splits",
]  # fmt: skip
