"""NeoX-style rotary embeddings over the whole head, with Phi-3-Small's two variants.

- Plain: positions are multiplied by `rope_position_scale`, frequencies `base ** (-2i / D)`.
- LongRoPE (the 128k model): each frequency is divided by a short or a long factor, and cos/sin
  are multiplied by the matching mscale. A sequence uses the long factors once its length
  passes `original_max_position_embeddings`; `rope_position_scale` is ignored.

cos/sin are computed from the positions on the fly (cheap, and capturable in a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .config import Phi3SmallConfig


class Rotary(torch.nn.Module):
    def __init__(self, config: Phi3SmallConfig, device: torch.device | str | None = None):
        super().__init__()
        d = config.head_dim
        self.config = config
        base_freq = config.rope_embedding_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
        rs = config.rope_scaling
        if rs is None:
            short = long = base_freq
        else:
            short = base_freq / torch.tensor(rs.short_factor, dtype=torch.float64)
            long = base_freq / torch.tensor(rs.long_factor, dtype=torch.float64)
        # Not part of the checkpoint (`rotary_emb.inv_freq` there is skipped by the loader).
        self.register_buffer("short_freq", short.float().to(device), persistent=False)  # [D/2]
        self.register_buffer("long_freq", long.float().to(device), persistent=False)  # [D/2]

    def cos_sin(
        self,
        positions: torch.Tensor,  # [T] int
        use_long: torch.Tensor | None,  # [T] bool: the token's sequence is past the original length
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, D] float32
        rs = self.config.rope_scaling
        pos = positions.float()
        if rs is None:
            angles = (pos * self.config.rope_position_scale)[:, None] * self.short_freq.float()[
                None, :
            ]  # [T, D/2]
            mscale = None
        else:
            short = pos[:, None] * self.short_freq.float()[None, :]
            long = pos[:, None] * self.long_freq.float()[None, :]
            if use_long is None:
                use_long = torch.zeros_like(positions, dtype=torch.bool)
            angles = torch.where(use_long[:, None], long, short)
            mscale = torch.where(use_long, rs.long_mscale, rs.short_mscale)[:, None].float()  # [T, 1]
        angles = torch.cat((angles, angles), dim=-1)  # [T, D]
        cos, sin = angles.cos(), angles.sin()
        if mscale is not None:
            cos, sin = cos * mscale, sin * mscale
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; rotate-half over all D dims, computed in float32."""
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


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
