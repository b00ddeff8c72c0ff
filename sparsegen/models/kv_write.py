"""Writing new keys and values into the paged KV cache, as an op that torch.compile keeps whole.

Eagerly, `write_kv` is two `index_copy_` calls. Under torch.compile / torch.export it goes
through the registered op `sparsegen_model::write_kv`, which declares that it mutates the two
cache tensors: traced as plain `index_copy_` on a graph input, the functional graph would copy
the whole cache (gigabytes) back into place on every step.
"""

from __future__ import annotations

import torch


def _write(k_cache, v_cache, slots, k, v) -> None:
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v)


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


def write_kv(k_cache, v_cache, slots, k, v) -> None:
    """k, v: [T, Hkv, D] into the caches at flat `slots` [T] (page * page_size + offset)."""
    if torch.compiler.is_compiling():
        torch.ops.sparsegen_model.write_kv(k_cache, v_cache, slots, k, v)
    else:
        _write(k_cache, v_cache, slots, k, v)
