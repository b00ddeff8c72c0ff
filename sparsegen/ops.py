"""Public entry points: `prefill`, `paged_decode` and `get_kernel`, with backend dispatch.

`impl=None` picks the compiled kernel on a capable GPU (sm_80+) and the reference elsewhere.
An explicit `impl` never falls back: if it cannot run here, `ImplUnavailableError` says why.

Under `torch.compile` / `torch.export` (`torch.compiler.is_compiling()`), `prefill` and
`paged_decode` call the custom ops `torch.ops.sparsegen.prefill` / `.paged_decode` registered
at the end of this module, which the tracer keeps as opaque nodes (no graph break, no tracing
into the launcher); their fake (meta) implementations give the output's shape and dtype without
running anything, so compiled graphs and CUDA graphs can hold them. In eager mode the entry
points call the same implementation directly: the custom-op dispatcher costs ~16 us a call on
the 2-core CI machine, a few percent of an 8K prefill. Either way every host-side check runs at
run time in `_prefill` / `_paged_decode`, never inside a traced region. A layer spec crosses
the op boundary as its canonical JSON string (`LayerSpec.to_json()`), parsed once per process.
The ops are inference-only: they have no autograd formula.

    out = torch.ops.sparsegen.paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
                                            layer.to_json(), None)   # [B, H, D]
"""

from __future__ import annotations

import functools

import torch

from . import env, reference
from .dtypes import FP8_DTYPES
from .errors import ImplUnavailableError, InputError
from .spec import LayerSpec
from .validate import (
    check_bool,
    check_cu_seqlens_values,
    check_decode_inputs,
    check_prefill_inputs,
    layer_scale,
)

KINDS = ("prefill", "decode")
PREFILL_IMPLS = ("triton", "reference")
DECODE_IMPLS = ("cuda", "reference")


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


def _check_impl(impl: object, allowed: tuple[str, ...]) -> None:
    if impl is not None and (not isinstance(impl, str) or impl not in allowed):
        raise InputError(f"impl must be one of {(None, *allowed)}, got {impl!r}")


def _check_layer(layer: object) -> LayerSpec:
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__} {layer!r:.80}")
    return layer


def _check_flag(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise InputError(f"{name} must be True, False or None, got {value!r}")


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer: LayerSpec, scale=None, *, impl=None, check=None,
            max_seqlen_q=None, max_seqlen_k=None, sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    """Block-sparse varlen prefill. q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D].

    `scale=None` takes the layer's (`LayerSpec.scale`, else 1/sqrt(head_dim)). `sinks` ([H]
    float32) is required exactly when the layer has `learned_sinks`; `k_scale` / `v_scale`
    (float32 [Hkv] or []) exactly when k/v are fp8 (DESIGN §1 and §3).

    `max_seqlen_q` / `max_seqlen_k` (flash-attn's names): the longest query / key length of the
    batch. Given, the compiled kernel sizes its grid from them and does not read cu_seqlens on
    the host (no device sync). `check=None` validates the cu_seqlens values on the host (one
    sync) unless they are given; `check=True` (or SPARSEGEN_DEBUG=1) always does, and then also
    checks the max_seqlen bounds; `check=False` never does. dtypes, shapes, devices and strides
    are always checked. The reference always checks everything.
    """
    _check_impl(impl, PREFILL_IMPLS)
    _check_flag("check", check)
    layer = _check_layer(layer)
    scale = layer_scale(scale, layer)
    if torch.compiler.is_compiling():
        return torch.ops.sparsegen.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, spec_json(layer), scale, impl,
                                           check, max_seqlen_q, max_seqlen_k, sinks, k_scale, v_scale)  # fmt: skip
    return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale, impl, check, max_seqlen_q, max_seqlen_k,
                    sinks, k_scale, v_scale)  # fmt: skip


def _prefill(q, k, v, cu_q, cu_k, layer: LayerSpec, scale: float, impl, check, max_q, max_k, sinks=None,
             k_scale=None, v_scale=None) -> torch.Tensor:  # fmt: skip
    """The implementation behind `prefill` and `torch.ops.sparsegen.prefill` (runs eagerly)."""
    if impl is None:
        on_gpu = isinstance(q, torch.Tensor) and gpu_capable(q.device)
        impl = "triton" if on_gpu and q.dtype in (torch.float16, torch.bfloat16) else "reference"
    if impl == "reference":
        return reference.prefill(
            q, k, v, cu_q, cu_k, layer, scale, sinks=sinks, k_scale=k_scale, v_scale=v_scale
        )
    interp = isinstance(q, torch.Tensor) and not gpu_capable(q.device)
    if interp:
        if not interpreter_enabled():
            where = q.device if isinstance(q, torch.Tensor) else "no tensor"
            raise ImplUnavailableError(
                f"impl='triton' needs q on a CUDA GPU of sm_80 or newer (q is on {where}); "
                "on a CPU set TRITON_INTERPRET=1 to run the generated kernel in Triton's interpreter"
            )
        if not interpreter_usable():
            raise ImplUnavailableError(
                "TRITON_INTERPRET=1 was set after Triton was imported in this process, so Triton's "
                "interpreter is not active; set it in the environment before starting Python"
            )
    if check is None:
        check = env.flag("SPARSEGEN_DEBUG") or (max_q is None and max_k is None)
    check_prefill_inputs(q, k, v, cu_q, cu_k, layer, allow_cpu=interp, kernel=True, check_values=False,
                         max_seqlen_q=max_q, max_seqlen_k=max_k, sinks=sinks, k_scale=k_scale,
                         v_scale=v_scale)  # fmt: skip
    _no_fp8_kernel("prefill", k)
    from .kernels.prefill import get_prefill_kernel

    kernel = get_prefill_kernel(layer, dtype=q.dtype)
    kernel.check_target(q)
    features = {} if sinks is None else {"sinks": sinks}  # only a kernel of a learned-sinks layer takes it
    launch = kernel.prepare(q, k, v, cu_q, cu_k, scale, max_seqlen_k=max_k, **features)
    if check:  # the one device sync, last, so the GPU idles only for the launch after it
        check_cu_seqlens_values(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q=max_q, max_seqlen_k=max_k)
    return launch()


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer: LayerSpec, scale=None, *, impl=None,
                 check=None, pdl=False, sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    """One decode step over a paged cache. q: [B, H, D], caches: [pages, page_size, Hkv, D].

    `scale`, `sinks`, `k_scale` and `v_scale` mean what they mean for `prefill`.

    `check=True` (or SPARSEGEN_DEBUG=1) validates seq_lens and every used page id on the host
    before the compiled kernel launches; the reference always does.

    `pdl=True` launches the compiled kernel with programmatic dependent launch on sm_90+ (a
    plain launch elsewhere, and for the reference): it starts while the kernel before it on the
    stream still runs and reads `seq_lens` and `block_tables` before waiting for that kernel to
    finish, then q and the caches after. Pass it only when the kernel right before does not
    write `seq_lens` or `block_tables` (the engine's decode step: the rotary kernel writes q and
    the new token's K/V, which are read after the wait). With more splits than the kernel
    merges itself, the separate merge kernel is launched the same way and waits for the partials.
    """
    _check_impl(impl, DECODE_IMPLS)
    _check_flag("check", check)
    check_bool("pdl", pdl)
    layer = _check_layer(layer)
    scale = layer_scale(scale, layer)
    if torch.compiler.is_compiling():
        return torch.ops.sparsegen.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, spec_json(layer),
                                                scale, impl, check, sinks, k_scale, v_scale)  # fmt: skip
    return _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale, impl, check, pdl, sinks,
                         k_scale, v_scale)  # fmt: skip


def _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer: LayerSpec, scale: float, impl, check,
                  pdl=False, sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    """The implementation behind `paged_decode` and `torch.ops.sparsegen.paged_decode`."""
    if impl is None:
        on_gpu = isinstance(q, torch.Tensor) and gpu_capable(q.device)
        impl = "cuda" if on_gpu and q.dtype in (torch.float16, torch.bfloat16) else "reference"
    if impl == "reference":
        return reference.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale, sinks=sinks,
                                      k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    if not (isinstance(q, torch.Tensor) and gpu_capable(q.device)):
        where = q.device if isinstance(q, torch.Tensor) else "no tensor"
        raise ImplUnavailableError(f"impl='cuda' needs q on a CUDA GPU of sm_80 or newer (q is on {where})")
    if check is None:
        check = env.flag("SPARSEGEN_DEBUG")
    check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, layer, allow_cpu=False, check_pages=check,
                        kernel=True, sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    from .kernels.decode import launch_checked

    return launch_checked(q, k_cache, v_cache, block_tables, seq_lens, layer, scale, pdl=pdl, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip


def _no_fp8_kernel(kind: str, k: torch.Tensor) -> None:
    """The compiled prefill kernels do not read fp8 K/V (the engine dequantises in its gather);
    the decode kernel does."""
    if k.dtype in FP8_DTYPES:
        raise ImplUnavailableError(
            f"the compiled {kind} kernels do not read fp8 K/V ({k.dtype}); impl='reference' does"
        )


def get_kernel(layer: LayerSpec, kind: str, *, dtype, arch=None, page_size: int | None = None, variant=None,
               kv_dtype=None):  # fmt: skip
    """A compiled, cached kernel for `layer`, callable like `prefill` / `paged_decode`.

    `arch` (e.g. "sm_90") defaults to the current GPU's; without a GPU it must be given, and
    the kernel is compiled ahead of time (it can be stored and inspected, not run). Decode
    kernels take `page_size` (default 16) and `kv_dtype` (None: q's dtype; an fp8 dtype such
    as torch.float8_e4m3fn or "fp8" for an fp8 cache); `variant` picks a registered
    implementation of the kind (default: prefill "tl", decode "cuda"; see sparsegen.kernels.base).
    """
    return lookup_kernel(layer, kind, dtype=dtype, arch=arch, page_size=page_size, variant=variant,
                         kv_dtype=kv_dtype).kernel  # fmt: skip


def lookup_kernel(
    layer: LayerSpec,
    kind: str,
    *,
    dtype,
    arch=None,
    page_size: int | None = None,
    variant=None,
    kv_dtype=None,
):
    """Like `get_kernel`, but returns `Lookup(kernel, status, seconds)`: status is "memory",
    "cached" (read from disk) or "compiled"."""
    from .kernels import base

    _check_layer(layer)
    if kind not in KINDS:
        raise InputError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "prefill" and page_size is not None:
        raise InputError(f"page_size is a decode option; prefill kernels take none (got {page_size!r})")
    return base.get(
        kind,
        layer,
        dtype=dtype,
        arch=arch,
        page_size=page_size,
        variant=variant,
        with_status=True,
        kv_dtype=kv_dtype,
    )


# The custom ops that `prefill` / `paged_decode` call while traced.


@functools.lru_cache(maxsize=256)
def layer_from_json(layer_json: str) -> LayerSpec:
    return LayerSpec.from_json(layer_json)


def spec_json(layer: LayerSpec) -> str:
    """The layer's canonical JSON, computed when the spec was made (`LayerSpec._json`): under
    torch.compile this is a read of a str attribute, a constant, so no call into the frozen
    instance is traced (torch 2.11's dynamo cannot reconstruct frozen dataclass instances)."""
    return layer._json


def _layer_json(layer: LayerSpec | str) -> str:
    if isinstance(layer, LayerSpec):
        return spec_json(layer)
    if isinstance(layer, str):
        return layer
    raise InputError(f"layer must be a LayerSpec or its JSON string, got {type(layer).__name__}")


@torch.library.custom_op("sparsegen::prefill", mutates_args=())
def _prefill_op(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    cu_seqlens_k: torch.Tensor,  # [B+1] int32
    layer_json: str,
    scale: float | None,
    impl: str | None = None,
    check: bool | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    sinks: torch.Tensor | None = None,  # [H] float32
    k_scale: torch.Tensor | None = None,  # [Hkv] or [] float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [Tq, H, D]
    layer = layer_from_json(layer_json)
    _check_impl(impl, PREFILL_IMPLS)
    scale = layer_scale(scale, layer)
    return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale, impl, check, max_seqlen_q, max_seqlen_k,
                    sinks, k_scale, v_scale)  # fmt: skip


@_prefill_op.register_fake
def _prefill_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, layer_json, scale, impl=None, check=None,
                  max_seqlen_q=None, max_seqlen_k=None, sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("sparsegen::paged_decode", mutates_args=())
def _paged_decode_op(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    layer_json: str,
    scale: float | None,
    impl: str | None = None,
    check: bool | None = None,
    sinks: torch.Tensor | None = None,  # [H] float32
    k_scale: torch.Tensor | None = None,  # [Hkv] or [] float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, H, D]
    layer = layer_from_json(layer_json)
    _check_impl(impl, DECODE_IMPLS)
    scale = layer_scale(scale, layer)
    return _paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layer, scale, impl, check, False, sinks,
                         k_scale, v_scale)  # fmt: skip


@_paged_decode_op.register_fake
def _paged_decode_fake(q, k_cache, v_cache, block_tables, seq_lens, layer_json, scale, impl=None, check=None,
                       sinks=None, k_scale=None, v_scale=None):  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def prefill_op(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale=None, *, sinks=None, k_scale=None,
               v_scale=None) -> torch.Tensor:  # fmt: skip
    """`sparsegen.prefill` through the registered op. q: [Tq, H, D] -> [Tq, H, D]."""
    return torch.ops.sparsegen.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, _layer_json(layer), scale,
                                       sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip


def paged_decode_op(q, k_cache, v_cache, block_tables, seq_lens, layer, scale=None, *, sinks=None, k_scale=None,
                    v_scale=None) -> torch.Tensor:  # fmt: skip
    """`sparsegen.paged_decode` through the registered op. q: [B, H, D] -> [B, H, D]."""
    return torch.ops.sparsegen.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, _layer_json(layer),
                                            scale, sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
