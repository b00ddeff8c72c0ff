"""The paged decode kernel through the lifecycle: the getter and `sparsegen.paged_decode`'s
entry, above `kernels.base`.

    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16)   # compiled + cached
    out = launch_checked(q, k_cache, v_cache, block_tables, seq_lens, layer, scale)   # [B, H, D]

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
    check_kernel_inputs,
    launch_matching,
    num_splits,
)

forget = base.forget


def get_decode_kernel(
    layer: LayerSpec, *, dtype, arch: str | None = None, page_size: int = 16, knobs: dict | None = None
) -> DecodeKernel:
    """The compiled kernel for this layer, dtype, page size and arch (default: this GPU's);
    `knobs` (benchmarks, tests) sets template knobs (decode_template.DEFAULT_KNOBS) and is part
    of the request, so such a kernel is cached like the default one."""
    return base.get("decode", layer, dtype=dtype, arch=arch, page_size=page_size, knobs=knobs)


def launch_checked(
    q, k_cache, v_cache, block_tables, seq_lens, layer, scale: float, *, kernel=None, pdl=False, sinks=None
):
    """Inputs already passed validate.check_decode_inputs(kernel=True): this kernel's own limits,
    fetch the kernel, launch on the current stream. Returns [B, H, D]."""
    check_kernel_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if kernel is None:
        kernel = get_decode_kernel(layer, dtype=q.dtype, page_size=k_cache.shape[1])
        return kernel.launch(q, k_cache, v_cache, block_tables, seq_lens, scale, pdl=pdl, sinks=sinks)
    return launch_matching(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale, pdl=pdl, sinks=sinks)


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
    )
    return launch_checked(q, k_cache, v_cache, block_tables, seq_lens, layer, layer_scale(scale, layer),
                          kernel=kernel, pdl=pdl, sinks=sinks)  # fmt: skip


__all__ = [
    "BLOCKS_PER_SM", "DEFAULT_KNOBS", "MAX_CONTEXT", "MAX_SPLITS", "MIN_SPLIT_TOKENS", "PAGE_SIZES", "TILE",
    "CudaDecode", "DecodeKernel", "check_kernel_inputs", "cuda_paged_decode", "forget", "get_decode_kernel",
    "launch_checked", "launch_matching", "num_splits",
]  # fmt: skip
