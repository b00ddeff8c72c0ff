"""Rotary variants of the decoder families, read from `rope_parameters` (transformers 5) or
`rope_theta` + `rope_scaling` (older files): default, linear, llama3 and yarn. Each gives the
inverse frequencies `[D/2]` and a cos/sin multiplier (yarn's attention factor; 1 otherwise);
the rotation itself is the NeoX rotate-half of `models.rope.Rotary.apply`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError
from ...hf_config import get_float, get_int

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeParams:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it
    truncate: bool = True  # yarn
    head_dim: int = 128


def read_ropes(cfg: dict[str, Any], defaults: dict[str, Any], head_dim: int, max_pos: int, local: bool,
               source: str) -> tuple[RopeParams, RopeParams | None]:  # fmt: skip
    """(the rotary of every layer or of the global ones, the windowed layers' own or None):
    `rope_parameters` (per layer type when `local`), else `rope_theta` + `rope_scaling` (and
    `rope_local_base_freq` for the windowed layers), else the family's defaults."""
    params = cfg.get("rope_parameters")
    if params is None and (cfg.get("rope_scaling") is not None or cfg.get("rope_theta") is not None):
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta")
        params.setdefault("rope_theta", defaults["rope_theta"] if theta is None else theta)
    if params is None:
        params = defaults.get(
            "rope_parameters", {"rope_type": "default", "rope_theta": defaults["rope_theta"]}
        )
    if isinstance(params, dict) and "full_attention" not in params:
        params = {"rope_theta": defaults["rope_theta"], **params}  # transformers' default theta
    if not local:
        if isinstance(params, dict) and cfg.get("partial_rotary_factor") is not None:
            # transformers folds a top-level partial_rotary_factor into the one rope_parameters
            params = {"partial_rotary_factor": cfg["partial_rotary_factor"], **params}
        return read_rope(params, head_dim, max_pos, source), None
    if isinstance(params, dict) and "full_attention" in params:
        full, slide = params["full_attention"], params.get("sliding_attention")
    else:
        full = params
        base = cfg.get("rope_local_base_freq", defaults.get("rope_local_base_freq"))
        slide = {"rope_type": "default", "rope_theta": base}
    return read_rope(full, head_dim, max_pos, source), read_rope(slide, head_dim, max_pos, source)


def read_rope(params: Any, head_dim: int, max_pos: int, source: str) -> RopeParams:
    kw = {"source": source, "error": CheckpointError}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object, got {params!r:.80}")
    if "rope_theta" not in params:
        raise CheckpointError(f"{source}: rope_parameters lacks 'rope_theta'")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope type {kind!r:.40} is not one sparsegen runs ({', '.join(ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"{source}: field 'partial_rotary_factor' is {params['partial_rotary_factor']!r:.40}; sparsegen "
            "rotates whole heads (1.0) only"
        )

    def f(key, default):
        return get_float({key: params.get(key, default)}, key, positive=True, **kw)

    theta = f("rope_theta", None)
    if kind == "default":
        return RopeParams("default", theta, head_dim=head_dim)
    factor = f("factor", None if kind != "yarn" else params.get("factor"))
    original = params.get("original_max_position_embeddings", max_pos if kind == "yarn" else None)
    original = get_int({"original_max_position_embeddings": original}, "original_max_position_embeddings",
                       minimum=1, **kw) if kind != "linear" else 0  # fmt: skip
    if kind == "linear":
        return RopeParams("linear", theta, factor, head_dim=head_dim)
    if kind == "llama3":
        return RopeParams("llama3", theta, factor, f("low_freq_factor", 1.0), f("high_freq_factor", 4.0),
                          original, head_dim=head_dim)  # fmt: skip
    attn = params.get("attention_factor")
    if attn is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all else (
            _yarn_mscale(factor, 1.0))  # fmt: skip
    truncate = params.get("truncate", True)
    return RopeParams("yarn", theta, factor, original_max_position_embeddings=original,
                      beta_fast=f("beta_fast", 32.0), beta_slow=f("beta_slow", 1.0),
                      attention_factor=float(attn), truncate=bool(truncate), head_dim=head_dim)  # fmt: skip


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(p: RopeParams) -> torch.Tensor:  # [D/2] float64
    d = p.head_dim
    base = p.theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if p.rope_type == "default":
        return base
    if p.rope_type == "linear":
        return base / p.factor
    if p.rope_type == "llama3":
        old = p.original_max_position_embeddings
        wavelen = 2 * math.pi / base
        low_wl, high_wl = old / p.low_freq_factor, old / p.high_freq_factor
        scaled = torch.where(wavelen > low_wl, base / p.factor, base)
        smooth = (old / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
        mixed = (1 - smooth) * scaled / p.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, mixed, scaled)
    # yarn: frequencies below the slow boundary interpolated (/ factor), above the fast one kept
    orig = p.original_max_position_embeddings

    def dim_at(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(p.theta))

    low, high = dim_at(p.beta_fast), dim_at(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return base / p.factor * (1 - keep) + base * keep


class DecoderRotary(torch.nn.Module):
    def __init__(self, params: RopeParams, device=None):
        super().__init__()
        self.scale = params.attention_factor if params.rope_type == "yarn" else 1.0
        self.register_buffer("inv_freq", inv_freq(params).float().to(device), persistent=False)  # [D/2]

    def cos_sin(self, positions: torch.Tensor, use_long=None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int -> cos, sin: [T, D] float32."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [T, D]
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos, sin
