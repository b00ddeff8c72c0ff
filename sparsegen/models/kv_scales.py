"""fp8 KV caches: the per-layer, per-KV-head float32 scales and the quantise / dequantise steps.

A cache of `torch.float8_e4m3fn` (or `float8_e5m2`) holds `k / k_scale[kv_head]` rounded to
fp8, saturated at the format's largest finite value (448 for e4m3, 57344 for e5m2), so a value
beyond the range becomes ±max and never NaN; dequantised key = `k.float() * k_scale[kv_head]`
(DESIGN §3, the kernels' contract). The scales are tensors on the cache's device allocated
once with the cache and updated in place (`copy_`), so CUDA graphs that captured their
addresses read the current values.

Where they come from: a checkpoint's `…self_attn.k_scale` / `v_scale` tensors (scalar or one
per KV head) when it carries them; otherwise the first prefill that writes the layer sets
`scale[h] = amax(|k[:, h]|) / fp8_max`, clamped to at least `MIN_SCALE` (an all-zero head
would otherwise get a zero scale), once, and later prompts keep them.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from ..dtypes import FP8_DTYPES

MIN_SCALE = 1e-12  # the smallest scale the amax calibration gives (an all-zero head; 1/scale stays finite)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


class KVScales:
    """One layer's scales: `k`, `v` float32 [Hkv] on the cache's device; `ready` once they hold
    the checkpoint's or the first prefill's values."""

    def __init__(self, num_kv_heads: int, dtype: torch.dtype, device: torch.device | str):
        self.dtype = dtype  # the cache's fp8 dtype
        self.k = torch.ones(num_kv_heads, dtype=torch.float32, device=device)  # [Hkv]
        self.v = torch.ones(num_kv_heads, dtype=torch.float32, device=device)  # [Hkv]
        self.ready = False

    def set(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Scales of shape [] or [Hkv] (a checkpoint's), broadcast to [Hkv], copied in place."""
        self.k.copy_(k_scale.to(torch.float32).expand_as(self.k))
        self.v.copy_(v_scale.to(torch.float32).expand_as(self.v))
        self.ready = True

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hkv, D], a prefill's fresh keys and values -> scale = amax / fp8_max per head."""
        top = fp8_max(self.dtype)
        for scale, x in ((self.k, k), (self.v, v)):
            # [Hkv]; non-finite entries do not count (an inf saturates when written, a NaN stays NaN)
            amax = torch.nan_to_num(x.detach().float().abs(), nan=0.0, posinf=0.0).amax(dim=(0, 2))
            scale.copy_((amax / top).clamp(min=MIN_SCALE))
        self.ready = True


class KVLayer(NamedTuple):
    """One layer's cache: k, v [num_pages, page_size, Hkv, D] and, for an fp8 cache, its scales."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales | None = None


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [T, Hkv, D] (model dtype), scale: [Hkv] float32 -> [T, Hkv, D] fp8, saturating."""
    top = fp8_max(dtype)
    return (x.float() / scale[:, None]).clamp(-top, top).to(dtype)  # ±inf -> ±max; NaN stays NaN


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [T, Hkv, D] fp8, scale: [Hkv] float32 -> [T, Hkv, D] in `dtype`."""
    return (x.float() * scale[:, None]).to(dtype)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_DTYPES


def layer_scales(kv_cache) -> KVScales | None:
    """A layer's cache scales: KVScales for an fp8 `KVLayer`, None for a (k, v) pair or no cache."""
    return kv_cache[2] if kv_cache is not None and len(kv_cache) > 2 else None


def cache_scales(kv_cache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_scale, v_scale) [Hkv] float32 of a layer's fp8 cache; (None, None) for a (k, v) pair."""
    scales = layer_scales(kv_cache)
    return (None, None) if scales is None else (scales.k, scales.v)


def calibrate_once(scales: KVScales | None, k: torch.Tensor, v: torch.Tensor, batch) -> None:
    """The first prefill that writes a layer with scales not yet set (no checkpoint scales) sets
    them from its fresh k, v [T, Hkv, D]; decode steps (CUDA-graph captures included) never do."""
    if scales is not None and not scales.ready and not batch.is_decode and k.shape[0] > 0:
        scales.calibrate(k, v)


# vLLM's names for an fp8 checkpoint's K/V scales: `model.layers.N.self_attn.k_scale` / `v_scale`
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([kv])_scale$")


def scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v") for a checkpoint's K/V scale tensor name, else None."""
    m = _SCALE_NAME.search(name)
    return (int(m.group(1)), m.group(2)) if m else None


def checked_scales(found: dict[tuple[int, str], torch.Tensor], num_layers: int, num_kv_heads: int,
                   where: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """A checkpoint's scale tensors by (layer, "k"/"v") -> layer -> (k_scale, v_scale), float32 of
    shape [] or [Hkv]; a layer with one of the two, a layer index beyond the model, a shape other
    than [], [1] or [Hkv], or a value not finite and > 0 is a CheckpointError."""
    from .config import CheckpointError

    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in sorted({i for i, _ in found}):
        if layer >= num_layers:
            raise CheckpointError(f"{where} has K/V scales for layer {layer}, but the model has {num_layers}")
        pair = []
        for kind in ("k", "v"):
            name = f"model.layers.{layer}.self_attn.{kind}_scale"
            t = found.get((layer, kind))
            if t is None:
                other = "v" if kind == "k" else "k"
                raise CheckpointError(f"{where} has {other}_scale for layer {layer} but not {name!r}")
            if not t.is_floating_point() or tuple(t.shape) not in ((), (1,), (num_kv_heads,)):
                raise CheckpointError(
                    f"{where}: {name!r} must be a float scalar, [1] or [{num_kv_heads}] (one per KV head), "
                    f"got {t.dtype} of shape {list(t.shape)}"
                )
            t = t.float().reshape(()) if t.numel() == 1 else t.float()  # [] or [Hkv]
            if not bool(((t > 0) & torch.isfinite(t)).all()):
                raise CheckpointError(f"{where}: {name!r} must be finite and > 0")
            pair.append(t)
        out[layer] = (pair[0], pair[1])
    return out
