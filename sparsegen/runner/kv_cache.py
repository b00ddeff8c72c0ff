"""The paged KV cache: per-layer page pools, a page allocator, and slot arithmetic.

Each layer owns `k` and `v` pools seen as `[num_pages, page_size, Hkv, D]`. A sequence holds
a list of page ids (its block table); token position p lives in page `pages[p // page_size]`
at offset `p % page_size`, i.e. flat slot `pages[p // page_size] * page_size + p % page_size`.
The last page is kept back as a scratch page: padded rows of a captured decode batch write
there, so they never touch a live sequence. `CachePages` is that page accounting alone (what
the scheduler allocates from); `KVCache` adds the pools. With tensor parallelism the driver holds
a `CachePages` and every rank a `KVCache` of the same number of pages.

Memory layout (`layout`): "head" (the default) stores each pool as `[num_pages, Hkv, page_size,
D]` and hands out its `.transpose(1, 2)` view, so one KV head's part of a page is one
contiguous run (4 KB for Phi-3-Small at 16 tokens a page) that the decode kernel reads in one
stream; "token" stores `[num_pages, page_size, Hkv, D]` contiguously (a token's row of every
head together). Every reader and writer goes through the view's strides, so both give the same
numbers; on an H200 the decode kernel read the head-major pages 2.2 % faster on dense layers at
32 x 8K (benchmarks/decode/bench_decode_layout.py, benchmarks/results/HISTORY.md).

An fp8 cache (`dtype` torch.float8_e4m3fn or float8_e5m2, EngineConfig.kv_cache_dtype) holds
one byte an element, so the same bytes hold twice bf16's tokens, and each layer carries its
`models.kv_scales.KVScales` (float32 [Hkv] for K and for V, allocated here once).
"""

from __future__ import annotations

import numpy as np
import torch

from ..dtypes import FP8_DTYPES
from ..errors import CacheOutOfMemory, EngineError
from ..models.kv_scales import KVLayer, KVScales
from .config import KV_LAYOUTS
from .page_pool import PageAllocator

__all__ = ["KV_LAYOUTS", "CacheOutOfMemory", "CachePages", "KVCache", "PageAllocator", "pages_for"]


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class CachePages:
    """The cache's pages without their memory: `num_pages` of `page_size` tokens, the last one
    kept as scratch, the others handed out by `allocator`."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise CacheOutOfMemory(f"the KV cache needs at least 2 pages (one is scratch), got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch_page = num_pages - 1
        self.allocator = PageAllocator(num_pages - 1)


class KVCache(CachePages):
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: str = "head",
    ):
        if layout not in KV_LAYOUTS:
            raise EngineError(f"KV cache layout must be one of {KV_LAYOUTS}, got {layout!r}")
        super().__init__(num_pages, page_size)
        self.layout = layout

        def pool() -> torch.Tensor:  # [num_pages, page_size, Hkv, D], in `layout`'s memory order
            if layout == "token":
                return torch.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device)
            heads = torch.zeros((num_pages, num_kv_heads, page_size, head_dim), dtype=dtype, device=device)
            return heads.transpose(1, 2)

        try:
            # k[l], v[l]: [num_pages, page_size, Hkv, D]
            self.k = [pool() for _ in range(num_layers)]
            self.v = [pool() for _ in range(num_layers)]
            # scales[l]: an fp8 cache's per-KV-head scales of layer l; None for bf16/fp16
            fp8 = dtype in FP8_DTYPES
            self.scales = [KVScales(num_kv_heads, dtype, device) if fp8 else None for _ in range(num_layers)]
        except torch.OutOfMemoryError:
            need = self.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) * num_pages
            raise CacheOutOfMemory(
                f"cannot allocate a KV cache of {num_pages} pages ({need / 2**30:.1f} GiB) on {device}; "
                "ask for fewer pages or less memory"
            ) from None

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor] | KVLayer]:
        """What the model's attention takes per layer: (k, v) for a bf16/fp16/fp32 cache, and
        `KVLayer(k, v, scales)` for an fp8 cache."""
        if self.scales[0] is None:
            return list(zip(self.k, self.v, strict=True))
        return [KVLayer(k, v, s) for k, v, s in zip(self.k, self.v, self.scales, strict=True)]

    def slot_array(self, pages: list[int], start: int, stop: int) -> np.ndarray:
        """[stop - start] int64 flat slots of positions start..stop-1 of a sequence.

        Every slot of the pages that hold those positions, then a slice: position p sits at
        index p - first * page_size of them. One broadcast add (numpy: no torch thread pool); no
        division, modulo or gather per token, and only the pages in the range are converted."""
        ps = self.page_size
        first, last = start // ps, pages_for(stop, ps)
        if stop < start or last > len(pages):
            raise EngineError(
                f"positions {start}..{stop - 1} need pages {first}..{last - 1} of the block table, "
                f"which has {len(pages)}"
            )
        table = np.array(pages[first:last], dtype=np.int64)  # [n]
        every = (table[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)  # [n * ps]
        return every[start - first * ps : stop - first * ps]

    def slots(self, pages: list[int], start: int, stop: int) -> torch.Tensor:
        """`slot_array` as a CPU tensor."""
        return torch.from_numpy(self.slot_array(pages, start, stop))


def set_checkpoint_scales(
    cache: KVCache, scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
) -> None:
    """A checkpoint's K/V scales (layer index -> (k_scale, v_scale), each [] or [Hkv], from
    `…self_attn.k_scale` / `v_scale`) into an fp8 cache; a bf16/fp16 cache ignores them (it
    stores the values unscaled). Layers the checkpoint has no scales for calibrate on their
    first prefill."""
    if not scales or cache.scales[0] is None:
        return
    for i, (k_scale, v_scale) in scales.items():
        if not 0 <= i < len(cache.scales):
            raise EngineError(
                f"checkpoint K/V scales for layer {i}, but the model has {len(cache.scales)} layers"
            )
        cache.scales[i].set(k_scale.to(cache.scales[i].k.device), v_scale.to(cache.scales[i].v.device))
