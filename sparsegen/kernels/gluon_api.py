"""Every Gluon name sparsegen uses, in one place, for every tested Triton (3.6 to 3.9).

Gluon (`triton.experimental.gluon`) is experimental and renames things between releases (for
example `tma.async_copy_global_to_shared` became `tma.async_load` in 3.8, and the old name
raises from 3.9). The rendered Gluon prefill module imports only from here, and the builder
takes its AST source class from here, so the rendered source is the same on every release and
a Triton upgrade is one edit in this file (the releases are listed in
`jit/triton_support.py`). `available()` says whether the installed Triton has what the kernel
needs; nothing here touches a GPU.
"""

from __future__ import annotations

import functools

try:  # the same paths on 3.6 - 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    gluon = gl = GluonASTSource = TensorDescriptor = None  # type: ignore[assignment]
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None  # type: ignore[assignment]
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if _IMPORT_ERROR is None:
    jit = gluon.jit
    constexpr_function = gluon.constexpr_function
    # TMA: global -> shared, completing on an mbarrier. 3.8 added `async_load` beside the old
    # name; 3.9 keeps the old name only as a stub that raises, so the new name comes first.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    MBarrierLayout = mbarrier.MBarrierLayout
    NVMMASharedLayout = gl.NVMMASharedLayout
    NVMMADistributedLayout = gl.NVMMADistributedLayout
    DotOperandLayout = gl.DotOperandLayout
    BlockedLayout = gl.BlockedLayout
    SliceLayout = gl.SliceLayout


# The builder's AST source class, by name (`jit.triton_build.aot_compile(ast_source=...)`): jit
# sits below kernels and imports it by this name, in a build worker too.
AST_SOURCE = f"{__name__}:GluonASTSource"


def available() -> str | None:
    """None when the installed Triton has the Gluon pieces the Hopper kernel uses, else why not."""
    return _IMPORT_ERROR


def shared_layout(block_shape: list[int], dtype_name: str):
    """The NVMMA shared layout TMA and wgmma agree on for a tile (largest swizzle that fits);
    made once per (shape, dtype), since every launch asks for it."""
    return _shared_layout(tuple(block_shape), dtype_name)


@functools.cache
def _shared_layout(block_shape: tuple[int, ...], dtype_name: str):
    dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def descriptor(tensor2d, block_shape: list[int], layout):
    """A host-side TMA descriptor over a 2-D view (last dim contiguous, 16-byte strides)."""
    return TensorDescriptor(tensor2d, list(tensor2d.shape), list(tensor2d.stride()), block_shape, layout)


def descriptor_type(dtype_name: str, block_shape: list[int], layout) -> str:
    """The signature string Triton parses back into a Gluon tensor-descriptor type."""
    dims = ", ".join(str(int(b)) for b in block_shape)
    return f"tensordesc<{dtype_name}[{dims}],{layout!r}>"
