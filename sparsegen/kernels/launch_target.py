"""What a model kernel's launch choices depend on besides its tensors: `Target`.

The GEMV and the fused kernels pick tiles, programmatic dependent launch (PDL) and triggers from
the device: tuned tiles on a GPU, few large programs in Triton's interpreter, PDL on sm_90+.
`target_of(device)` says so for a launch; `aot_target(arch)` says the same for a GPU that is
absent, so that `sparsegen compile --model-kernels` builds the binaries the launches will ask for.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import env

AOT_SM_COUNT = 132  # an H100 / H200 SXM: what untuned shapes size their grids for ahead of time


class Target(NamedTuple):  # a NamedTuple: made at every launch, it must be cheap
    cuda: bool  # a CUDA device (tuned tiles apply); False: Triton's interpreter on the CPU
    sm_count: int  # multiprocessors (1 in the interpreter, which runs programs one by one)
    pdl: bool  # programmatic dependent launch: sm_90+, and SPARSEGEN_NO_PDL unset


def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch on this device: sm_90+, unless SPARSEGEN_NO_PDL (the one
    switch for every PDL launch and trigger of the model)."""
    return env.supports_pdl(device) and not env.flag("SPARSEGEN_NO_PDL")


def pdl_allowed(device: torch.device, rows: int, max_rows: int) -> bool:
    """`pdl_capable`, for a kernel over `rows` <= `max_rows` rows."""
    return rows <= max_rows and pdl_capable(device)


_SM_COUNTS: dict[int, int] = {}  # CUDA device index -> multiprocessors (a cache)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _SM_COUNTS.get(index)
    if found is None:
        found = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return found


def target_of(device: torch.device) -> Target:
    """The target of a launch on `device` (PDL read from the environment now)."""
    return Target(device.type == "cuda", sm_count(device), pdl_capable(device))


def aot_target(arch: str) -> Target:
    """The target of launches on a GPU of `arch` that is not here."""
    return Target(
        True, AOT_SM_COUNT, env.parse_arch(arch) >= env.PDL_MIN_ARCH and not env.flag("SPARSEGEN_NO_PDL")
    )
