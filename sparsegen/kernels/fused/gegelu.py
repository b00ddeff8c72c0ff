"""GeGeLU over interleaved (gate, linear) pairs as one Triton kernel: `[..., 2F] -> [..., F]`.

Phi-3-Small's up_proj output holds each pair's gate and linear part side by side; the kernel
(templates/gegelu.py.jinja) reads each run of pairs as one contiguous load, computes in float32
and rounds once, as `models.layers.gegelu` (the plain path and the tests' oracle) does.
"""

from __future__ import annotations

import torch

from ..families.model_triton import GEGELU
from ..triton_kernel import TritonLauncher

BLOCK = 1024  # outputs per program


LAUNCH = TritonLauncher(GEGELU)


def _plan(x: torch.Tensor, limit: float):
    x = x.contiguous()
    y = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    n = y.numel()
    if not n:
        return y, None
    return y, ((-(-n // BLOCK), 1, 1), (x, y, n, float(limit)), (BLOCK,), (), x.dtype)


def gegelu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """x: [..., 2F] -> [..., F], one kernel."""
    y, launch = _plan(x, limit)
    if launch is not None:
        LAUNCH(*launch)
    return y


def request(x: torch.Tensor, limit: float, *, arch: str):
    """The request a `gegelu(x, limit)` launch makes on a GPU of `arch` (x may be a meta tensor)."""
    launch = _plan(x, limit)[1]
    return None if launch is None else LAUNCH.request(*launch[1:], arch)
