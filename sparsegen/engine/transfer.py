"""Host-to-device copies that never make the host wait for the GPU.

A plain `.to("cuda")` or `torch.tensor(..., device="cuda")` from pageable memory synchronises
with the stream, i.e. waits for a decode step still running (`engine.inflight` launches the next
step before the last one ends). These go through pinned memory with a non-blocking copy; the
caching host allocator keeps each pinned block until its copy has run, so nothing overwrites
it early. On a CPU they are plain copies.
"""

from __future__ import annotations

import torch


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` ready for a non-blocking copy to `device`: a pinned copy for a GPU, else itself."""
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (see the module docstring)."""
    return staged(host, device).to(device, non_blocking=True)


def on_device(device: torch.device, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device` (see the module docstring)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_in(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Host to the existing buffer `dst` (see the module docstring); stream-ordered after every
    kernel launched before it, so a graph replayed earlier has read `dst` by then."""
    dst.copy_(staged(host, dst.device), non_blocking=True)
