"""`RopeWrite`: the rotary embedding and K/V cache write that a decode step's QKV kernel does
after its matmul (the epilogue of `linear.gemv` and `linear.gemm_rows`), and its checks.

Phi-3-Small's QKV weight rows are Hkv slots of G query heads, then k, then v (head_dim D
each); the kernel rotates q and k NeoX-style with the float32 cos/sin tables of each token's
position, returns q, and writes k and v into the paged caches at each token's flat slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import InputError


@dataclass(frozen=True)
class RopeWrite:
    """A decode step's QKV projection with Phi-3-Small's rotary and the K/V cache write fused in
    (`gemv.gemv(..., rope=)` for one token, `gemm_rows.gemm_rows(..., rope=)` for 2..32): the
    weight's rows are Hkv slots of `group` query heads, k and v."""

    cos: torch.Tensor  # [T, D] (or [D] for one token) float32: Rotary.cos_sin at each token's position
    sin: torch.Tensor  # [T, D] (or [D])
    group: int  # G query heads per KV head
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D], any page layout, last dim contiguous
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, D], the same strides
    slot: torch.Tensor  # [T] int64: page * page_size + offset of each token

    def checked(self, n: int, m: int, x: torch.Tensor, who: str) -> tuple[torch.Tensor, torch.Tensor]:
        """InputError (its message starting with `who`) unless this write fits a QKV weight of
        `n` rows and `m` tokens on the device and dtype of the input `x`; returns cos and sin as
        contiguous float32 [m, D]."""
        kc, vc = self.k_cache, self.v_cache
        if kc.dim() != 4 or kc.shape != vc.shape or kc.stride() != vc.stride() or kc.stride(3) != 1:
            raise InputError(f"{who}: the caches must be equal [pages, page_size, Hkv, D] with a contiguous last "
                             f"dim, got {tuple(kc.shape)} {kc.stride()} and {tuple(vc.shape)} {vc.stride()}")  # fmt: skip
        _, _, hkv, d = kc.shape
        g = self.group
        if (
            isinstance(g, bool)
            or not isinstance(g, int)
            or g < 1
            or n != hkv * (g + 2) * d
            or d % 2
            or d & (d - 1)
        ):
            raise InputError(f"{who}: {n} weight rows are not Hkv={hkv} x (G={g!r} + 2) x D={d} "
                             "with D a power of two")  # fmt: skip
        if kc.dtype != x.dtype or kc.device != x.device or vc.device != x.device:
            raise InputError(
                f"{who}: caches {kc.dtype} on {kc.device} do not match x {x.dtype} on {x.device}"
            )
        tables = (self.cos, self.sin)
        if any(t.numel() != m * d or t.device != x.device for t in tables):
            raise InputError(f"{who}: cos and sin must be [{m}, {d}] on {x.device}, got "
                             f"{tuple(self.cos.shape)} and {tuple(self.sin.shape)}")  # fmt: skip
        slot = self.slot
        if (
            slot.shape != (m,)
            or slot.dtype != torch.int64
            or slot.device != x.device
            or (m > 1 and slot.stride(0) != 1)
        ):
            raise InputError(f"{who}: slot must be a contiguous [{m}] int64 tensor on {x.device}, got "
                             f"{tuple(slot.shape)} {slot.dtype}")  # fmt: skip
        cos, sin = (t.reshape(m, d).float().contiguous() for t in tables)
        return cos, sin
