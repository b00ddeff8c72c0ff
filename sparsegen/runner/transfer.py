"""Host-to-device copies that never make the host wait for the GPU.

A plain `.to("cuda")` or `torch.tensor(..., device="cuda")` from pageable memory synchronises
with the stream, i.e. waits for a decode step still running (`runner.inflight` launches the next
step before the last one ends). These go through pinned memory with a non-blocking copy; the
caching host allocator keeps each pinned block until its copy has run, so nothing overwrites
it early. On a CPU they are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
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


def packed_to_device(
    parts: Seq[np.ndarray | None], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor | None]:
    """Several 1-D host arrays of one dtype on `device` in one copy, returned as views of the
    device buffer, in order (None stays None).

    The arrays are written by numpy straight into one pinned host buffer (on a GPU; a plain one
    on a CPU), each part at a multiple of ALIGN elements so that every view is as aligned as a
    tensor of its own (kernels specialised on pointer alignment see no difference). numpy and the
    single non-blocking copy keep torch's CPU thread pool out of it: waking it costs more than
    these few hundred kilobytes take to copy. The padding between parts is never read."""
    want = torch.empty(0, dtype=dtype).numpy().dtype
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        if p is not None:
            if not isinstance(p, np.ndarray) or p.ndim != 1 or p.dtype != want:
                got = f"{type(p).__name__} of dtype {getattr(p, 'dtype', None)}, shape {tuple(getattr(p, 'shape', ()))}"
                raise InputError(f"packed parts must be 1-D {want} arrays, got a {got}")
            total += -(-p.size // ALIGN) * ALIGN
    cuda = torch.device(device).type == "cuda"
    host = torch.empty(max(total, 1), dtype=dtype, pin_memory=cuda)
    view = host.numpy()
    for p, o in zip(parts, offsets, strict=True):
        if p is not None:
            view[o : o + p.size] = p
    dev = host.to(device, non_blocking=True) if cuda else host
    return [None if p is None else dev[o : o + p.size] for p, o in zip(parts, offsets, strict=True)]
