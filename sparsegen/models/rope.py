"""NeoX-style rotary embeddings over the whole head, with Phi-3-Small's two variants.

- Plain: positions are multiplied by `rope_position_scale`, frequencies `base ** (-2i / D)`.
- LongRoPE (the 128k model): each frequency is divided by a short or a long factor, and cos/sin
  are multiplied by the matching mscale. A sequence uses the long factors once its length
  passes `original_max_position_embeddings`; `rope_position_scale` is ignored.

cos/sin are computed from the positions on the fly (cheap, and capturable in a CUDA graph).
`RopeWrite` (the rotary and K/V cache write fused into a decode step's QKV kernel) is the
kernels' (`kernels.linear.rope_write`); the model builds one per decode step.
"""

from __future__ import annotations

import torch

from ..kernels.linear.rope_write import RopeWrite
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


__all__ = ["RopeWrite", "Rotary"]
