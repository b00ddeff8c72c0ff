"""`sparsegen::prefill` and `sparsegen::paged_decode` as torch.library custom ops.

Registered ops are opaque to torch.compile and torch.export (no graph break, no tracing into
the launcher) and have fake (meta) implementations that give the output's shape and dtype
without running anything, so compiled graphs and CUDA graphs can hold them. A layer spec
crosses the op boundary as its canonical JSON string (`LayerSpec.to_json()`), parsed once per
process. `sparsegen.prefill` / `sparsegen.paged_decode` call these ops whenever they are traced;
the ops are inference-only (no autograd formula is registered).

    out = torch.ops.sparsegen.paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                            layer.to_json(), None)   # [B, H, D]
"""

from __future__ import annotations

import functools

import torch

from .errors import InputError
from .spec import LayerSpec


@functools.lru_cache(maxsize=256)
def layer_from_json(layer_json: str) -> LayerSpec:
    return LayerSpec.from_json(layer_json)


def spec_json(layer: LayerSpec) -> str:
    """The layer's canonical JSON, computed when the spec was made (`LayerSpec._json`): under
    torch.compile this is a read of a str attribute, a constant, so no call into the frozen
    instance is traced (torch 2.11's dynamo cannot reconstruct frozen dataclass instances)."""
    return layer._json


def _layer_json(layer: LayerSpec | str) -> str:
    if isinstance(layer, LayerSpec):
        return spec_json(layer)
    if isinstance(layer, str):
        return layer
    raise InputError(f"layer must be a LayerSpec or its JSON string, got {type(layer).__name__}")


@torch.library.custom_op("sparsegen::prefill", mutates_args=())
def _prefill_op(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    cu_seqlens_k: torch.Tensor,  # [B+1] int32
    layer_json: str,
    scale: float | None,
    impl: str | None = None,
    check: bool | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:  # [Tq, H, D]
    from . import ops
    from .validate import softmax_scale

    layer = layer_from_json(layer_json)
    ops._check_impl(impl, ops.PREFILL_IMPLS)
    scale = softmax_scale(scale, layer.head_dim)
    return ops._prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale, impl, check, max_seqlen_q, max_seqlen_k
    )


@_prefill_op.register_fake
def _prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, layer_json, scale, impl=None, check=None,
                  max_seqlen_q=None, max_seqlen_k=None):  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("sparsegen::paged_decode", mutates_args=())
def _paged_decode_op(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    layer_json: str,
    scale: float | None,
    impl: str | None = None,
    check: bool | None = None,
) -> torch.Tensor:  # [B, H, D]
    from . import ops
    from .validate import softmax_scale

    layer = layer_from_json(layer_json)
    ops._check_impl(impl, ops.DECODE_IMPLS)
    scale = softmax_scale(scale, layer.head_dim)
    return ops._paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale, impl, check)


@_paged_decode_op.register_fake
def _paged_decode_fake(q, k_cache, v_cache, block_tables, seq_lens, layer_json, scale, impl=None, check=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale=None) -> torch.Tensor:
    """`sparsegen.prefill` through the registered op. q: [Tq, H, D] -> [Tq, H, D]."""
    return torch.ops.sparsegen.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, _layer_json(layer), scale)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale=None) -> torch.Tensor:
    """`sparsegen.paged_decode` through the registered op. q: [B, H, D] -> [B, H, D]."""
    return torch.ops.sparsegen.paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, _layer_json(layer), scale
    )
