"""Host-to-device copies that never make the host wait for the GPU.

A plain `.to("cuda")` or `torch.tensor(..., device="cuda")` from pageable memory synchronises
with the stream, i.e. waits for a decode step still running (`engine.inflight` launches the next
step before the last one ends). These go through pinned memory with a non-blocking copy; the
caching host allocator keeps each pinned block until its copy has run, so nothing overwrites
it early. On a CPU they are plain copies.
"""

from __future__ import annotations

import torch

from ..errors import InputError


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


ALIGN = 16  # elements: each packed part starts a multiple of 64 (int32) or 128 (int64) bytes in


def packed_to_device(parts: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Several 1-D host tensors of one dtype on `device` in one copy: they are packed into one host
    buffer (each part at a multiple of ALIGN elements, so that every view is as aligned as a tensor
    of its own and kernels specialised on pointer alignment see no difference), copied as
    `to_device` does, and returned as views of the device buffer, in order; None stays None."""
    given = [p for p in parts if p is not None]
    if not given:
        return list(parts)
    dtype = given[0].dtype
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        if p is not None:
            if p.dim() != 1 or p.dtype != dtype:
                raise InputError(f"packed parts must be 1-D {dtype}, got {p.dtype} of shape {tuple(p.shape)}")
            total += -(-p.numel() // ALIGN) * ALIGN
    host = torch.zeros(max(total, 1), dtype=dtype)
    for p, o in zip(parts, offsets, strict=True):
        if p is not None:
            host[o : o + p.numel()] = p
    dev = to_device(host, device)
    return [None if p is None else dev[o : o + p.numel()] for p, o in zip(parts, offsets, strict=True)]
