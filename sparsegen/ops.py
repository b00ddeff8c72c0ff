"""Public entry points: `prefill`, `paged_decode` and `get_kernel`, with backend dispatch.

`impl=None` picks the compiled kernel on a capable GPU (sm_80+) and the reference elsewhere.
An explicit `impl` never falls back: if it cannot run here, `ImplUnavailableError` says why.
"""

from __future__ import annotations

import torch

from . import env, reference
from .errors import ImplUnavailableError, InputError
from .spec import LayerSpec

KINDS = ("prefill", "decode")


def interpreter_enabled() -> bool:
    return env.interpreting()


def interpreter_usable() -> bool:
    """TRITON_INTERPRET=1 only takes effect if it was set before Triton was first imported:
    Triton decorates its own library functions at import time."""
    if not interpreter_enabled():
        return False
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sigmoid, InterpretedFunction)


gpu_capable = env.gpu_capable


def _check_impl(impl: str | None, allowed: tuple[str, ...]) -> None:
    if impl not in (None, *allowed):
        raise InputError(f"impl must be one of {(None, *allowed)}, got {impl!r}")


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer: LayerSpec, scale=None, *, impl=None, check=True):
    """Block-sparse varlen prefill. q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D].

    check=False lets the compiled kernel skip reading cu_seqlens on the host (no device sync,
    for callers that built them, like the engine); dtypes, shapes and strides are still checked.
    The reference always checks everything.
    """
    _check_impl(impl, ("triton", "reference"))
    if impl is None:
        on_gpu = isinstance(q, torch.Tensor) and gpu_capable(q.device)
        impl = "triton" if on_gpu and q.dtype in (torch.float16, torch.bfloat16) else "reference"
    if impl == "reference":
        return reference.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale)
    if isinstance(q, torch.Tensor) and not gpu_capable(q.device):
        if not interpreter_enabled():
            raise ImplUnavailableError(
                f"impl='triton' needs q on a CUDA GPU of sm_80 or newer (q is on {q.device}); "
                "on a CPU set TRITON_INTERPRET=1 to run the generated kernel in Triton's interpreter"
            )
        if not interpreter_usable():
            raise ImplUnavailableError(
                "TRITON_INTERPRET=1 was set after Triton was imported in this process, so Triton's "
                "interpreter is not active; set it in the environment before starting Python"
            )
    from .kernels.prefill import triton_prefill

    return triton_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale, check=check)


def paged_decode(
    q, k_cache, v_cache, block_tables, seq_lens, layer: LayerSpec, scale=None, *, impl=None, check=None
):
    """One decode step over a paged cache. q: [B, H, D], caches: [pages, page_size, Hkv, D].

    `check=True` (or SPARSEGEN_DEBUG=1) validates seq_lens and every used page id on the host
    before the compiled kernel launches; the reference always does.
    """
    _check_impl(impl, ("cuda", "reference"))
    if impl is None:
        on_gpu = isinstance(q, torch.Tensor) and gpu_capable(q.device)
        impl = "cuda" if on_gpu and q.dtype in (torch.float16, torch.bfloat16) else "reference"
    if impl == "reference":
        return reference.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale)
    if not (isinstance(q, torch.Tensor) and gpu_capable(q.device)):
        where = q.device if isinstance(q, torch.Tensor) else "no tensor"
        raise ImplUnavailableError(f"impl='cuda' needs q on a CUDA GPU of sm_80 or newer (q is on {where})")
    if check is None:
        check = env.flag("SPARSEGEN_DEBUG")
    from .kernels.decode import cuda_paged_decode

    return cuda_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale, check=check)


def get_kernel(layer: LayerSpec, kind: str, *, dtype, arch=None, page_size: int = 16):
    """A compiled, cached kernel for `layer`, callable like `prefill` / `paged_decode`.

    `arch` (e.g. "sm_90") defaults to the current GPU's; without a GPU it must be given, and
    the kernel is compiled ahead of time (it can be stored and inspected, not run).
    """
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
    if kind == "prefill":
        from .kernels.prefill import get_prefill_kernel

        return get_prefill_kernel(layer, dtype=dtype, arch=arch)
    if kind == "decode":
        from .kernels.decode import get_decode_kernel

        return get_decode_kernel(layer, dtype=dtype, arch=arch, page_size=page_size)
    raise InputError(f"kind must be one of {KINDS}, got {kind!r}")
