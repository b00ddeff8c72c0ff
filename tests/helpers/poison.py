"""NaN-poisoned outputs for the GPU kernel tests: leave NaNs in the allocator block a kernel's
output will most likely reuse, so that an output element the kernel never writes shows as NaN."""

from __future__ import annotations

import torch


def poison_next_alloc(shape, device="cuda") -> None:
    """Allocate `shape` float32 NaNs on `device` and free them again (the caching allocator hands
    the same block to the next allocation of that size)."""
    junk = torch.full(shape, float("nan"), device=device)
    del junk
