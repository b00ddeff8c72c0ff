"""A checkpoint config's `dtype` / `torch_dtype`, read as transformers' `PretrainedConfig` reads it.

transformers takes `dtype` when it is not null, else `torch_dtype` (the older spelling, then
ignored whatever it holds), and turns a string into `getattr(torch, name)`: `"bfloat16"`,
`"half"`, `"float"` and every other torch dtype name load; an unknown word (`"bf17"`,
`"float128"`, `"auto"`, `"torch.float16"`) fails. Of what it accepts, sparsegen takes the
floating dtypes of 16 bits or more (its weights are cast to the engine's dtype from those);
an integer, boolean, complex or 8-bit float dtype says the weights are quantized or not a
model's at all, which sparsegen cannot honour, so it is refused too. A dict (transformers'
per-sub-model map) is checked entry by entry. Every refusal is a CheckpointError naming the
file and the field.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError


def _one(value: Any, field: str, source: str) -> torch.dtype:
    if not isinstance(value, str):
        raise CheckpointError(f"{source}: field {field!r} must be a dtype name, got {value!r:.60}")
    dtype = getattr(torch, value, None) if value.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(
            f"{source}: field {field!r} is {value!r:.60}, which names no torch dtype "
            "(transformers reads it as getattr(torch, name): bfloat16, float16, float32, ...)"
        )
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise CheckpointError(
            f"{source}: field {field!r} is {value!r}: sparsegen loads floating weights of 16 bits "
            "or more (bfloat16, float16, float32, float64), not a quantized or non-float model"
        )
    return dtype


def config_dtype(cfg: dict[str, Any], source: str) -> torch.dtype | dict[str, torch.dtype] | None:
    """The dtype `cfg` declares for its weights (None: it declares none)."""
    field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    value = cfg.get(field)
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(k): _one(v, f"{field}[{k!r:.40}]", source) for k, v in value.items()}
    return _one(value, field, source)
