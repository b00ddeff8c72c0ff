"""The one kernel lifecycle every compiled kernel goes through: request -> memo -> render -> key ->
disk cache -> kernel.

    req = KernelRequest.make("prefill", layer, dtype=torch.bfloat16, arch="sm_90")
    found = lookup(req)              # Lookup(kernel, status, seconds); status beside the kernel
    found.kernel.name, found.kernel.key, found.kernel.path, found.kernel.source

A lookup walks one way: `lookup` memo (per process) -> the family renders the source for the
request -> `jit.cache.make_key` hashes that RENDERED source (so every input that decides the
source -- template bytes and the Python computing its constants -- is in the key) together
with the request's params -> the disk cache loads the entry or calls the family's `build`
(refused under SPARSEGEN_DISABLE_JIT=1, naming the kernel) -> the family's `load` makes the
kernel.

A request is (kind, params, dtype, arch, variant); `params` is the family's frozen, validated
description of everything else that decides the kernel. Families, one `Family` object per
(kind, variant):

    kind             variant  params                 module                         toolchain
    prefill          "tl"     AttentionParams        kernels.families.prefill_tl    Triton
    prefill          "gluon"  AttentionParams        kernels.families.prefill_gluon Triton (Gluon)
    decode           "cuda"   AttentionParams        kernels.families.decode        NVRTC
    gemv             "triton" TritonParams           kernels.families.model_triton Triton
    gemm_rows        "cuda"   linear.gemm_rows.Build kernels.families.gemm_rows     NVRTC
    rotary_kv_write  "triton" TritonParams           kernels.families.model_triton Triton
    gegelu           "triton" TritonParams           kernels.families.model_triton Triton
    add_norm         "triton" TritonParams           kernels.families.model_triton Triton

Attention requests come from `KernelRequest.make` (`sparsegen.get_kernel`); `knobs` there are
template / config settings beyond a family's defaults (benchmarks, tests), part of the request
and so of the key, cached like any other kernel. The model kernels' requests are made by their
launchers (`kernels.triton_kernel`, `kernels.linear.gemm_rows`) with `KernelRequest.of`.

A new family plugs in by a module defining a `Family` subclass (`kind`, `variant`, `check`,
`config`, `name`, `render`, `build`, `required`, `load`; `spec_json` / `key_extra` if its params
are not AttentionParams) that ends with `register(TheFamily())`, and one line in
`FAMILY_MODULES` below, so `lookup` imports the module on first use.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import dtypes, env
from ..errors import ArchError, InputError, RenderLimitError
from ..jit import cache
from ..spec import LayerSpec
from .family import INTERPRETER_ARCH, AttentionParams, Family, Kernel, Request, register, registered

KINDS = ("prefill", "decode")  # attention kinds (`sparsegen.get_kernel`)
MODEL_KINDS = ("gemv", "gemm_rows", "rotary_kv_write", "gegelu", "add_norm")  # the model's kernels
FAMILY_MODULES: dict[tuple[str, str], str] = {
    ("prefill", "tl"): "sparsegen.kernels.families.prefill_tl",
    ("prefill", "gluon"): "sparsegen.kernels.families.prefill_gluon",
    ("decode", "cuda"): "sparsegen.kernels.families.decode",
    ("gemv", "triton"): "sparsegen.kernels.families.model_triton",
    ("gemm_rows", "cuda"): "sparsegen.kernels.families.gemm_rows",
    ("rotary_kv_write", "triton"): "sparsegen.kernels.families.model_triton",
    ("gegelu", "triton"): "sparsegen.kernels.families.model_triton",
    ("add_norm", "triton"): "sparsegen.kernels.families.model_triton",
}
DEFAULT_PAGE_SIZE = 16


def default_variant(kind: str, arch: str, layer: LayerSpec | None = None, dtype: str | None = None) -> str:
    """The variant used when the caller names none: for prefill on sm_90, the Gluon kernel
    whenever it covers the layer and dtype (SPARSEGEN_PREFILL_TL=1 keeps the tl kernel), except a
    narrow-window layer whose query heads the tl kernel packs (`prefill_template.
    packs_query_heads`: faster there), else tl; every other kind has one variant."""
    if kind != "prefill":
        return next(v for k, v in FAMILY_MODULES if k == kind)
    if arch == "sm_90" and layer is not None and not env.flag("SPARSEGEN_PREFILL_TL"):
        from . import gluon_api, gluon_fallback, prefill_gluon_template, prefill_template

        if prefill_template.packs_query_heads(layer, arch):
            return "tl"
        missing = gluon_api.available()
        if missing is None and prefill_gluon_template.covers(layer, dtype) is None:
            return "gluon"
        if missing is not None:
            gluon_fallback.warn_once(f"the installed Triton has no usable Gluon ({missing})")
    return "tl"


def checked_knobs(knobs: object) -> tuple[tuple[str, int], ...]:
    """`knobs` (None or a dict of name -> int / bool) as a sorted tuple; the family checks the
    names and values."""
    if knobs is None:
        return ()
    if not isinstance(knobs, dict):
        raise InputError(f"knobs must be a dict of name -> int, got {type(knobs).__name__}")
    for name, value in knobs.items():
        if not isinstance(name, str) or not isinstance(value, int):
            raise InputError(f"knob {name!r} must be a str naming an int (or bool) value, got {value!r}")
    return tuple(sorted(knobs.items()))


@dataclass(frozen=True)
class KernelRequest(Request):
    """A checked request: build it with `make` (attention) or `of` (any family), which check
    every field, the family's own checks included."""

    @classmethod
    def make(
        cls, kind, layer, *, dtype, arch=None, page_size=None, variant=None, knobs=None, kv_dtype=None
    ) -> KernelRequest:
        """A checked attention request; `arch=None` means this GPU's, or the interpreter under
        TRITON_INTERPRET for prefill. `kv_dtype` (None: q's dtype; an fp8 dtype or name) is the
        K/V cache's element type."""
        if kind not in KINDS:
            raise InputError(f"kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(layer, LayerSpec):
            raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
        if arch is None and kind == "prefill" and env.interpreting():
            arch = INTERPRETER_ARCH
        elif arch == INTERPRETER_ARCH and kind == "prefill":
            pass
        else:
            arch = env.resolve_arch(arch)
        interp = arch == INTERPRETER_ARCH
        name = dtypes.resolve(dtype, kernel=not interp).name
        if kind == "decode":
            page_size = DEFAULT_PAGE_SIZE if page_size is None else page_size
        elif page_size is not None:
            raise InputError(f"page_size is a decode option; prefill kernels take none (got {page_size!r})")
        else:
            page_size = 0
        variant = default_variant(kind, arch, layer, name) if variant is None else variant
        params = AttentionParams(layer, page_size, checked_knobs(knobs), dtypes.kv_kernel_name(kv_dtype))
        return cls.of(kind, params, dtype=name, arch=arch, variant=variant)

    @classmethod
    def of(cls, kind, params, *, dtype: str, arch: str, variant: str | None = None) -> KernelRequest:
        """A request of any family, checked by that family (`Family.check`)."""
        if kind not in KINDS + MODEL_KINDS:
            raise InputError(f"kind must be one of {KINDS + MODEL_KINDS}, got {kind!r}")
        variant = default_variant(kind, arch) if variant is None else variant
        if not isinstance(variant, str) or (kind, variant) not in FAMILY_MODULES:
            known = sorted(v for k, v in FAMILY_MODULES if k == kind)
            raise InputError(f"variant must be one of {known} for {kind} kernels, got {variant!r}")
        request = cls(kind, params, dtype, arch, variant)
        fam = family(request)
        fam.check_layer(request)
        fam.check(request)
        return request


def family(request: Request) -> Family:
    """The family of a request, importing its module (FAMILY_MODULES) on first use."""
    fam = registered(request.kind, request.variant)
    if fam is None:
        importlib.import_module(FAMILY_MODULES[(request.kind, request.variant)])
        fam = registered(request.kind, request.variant)
    return fam


@dataclass(frozen=True)
class Lookup:
    """A kernel and how this lookup found it: "memory" (this process had it), "cached" (read from
    disk) or "compiled" (built now); `seconds` is what this lookup took."""

    kernel: Any
    status: str
    seconds: float


@dataclass(frozen=True)
class Keyed:
    """A request's rendered source and key, before any build (`key_of`)."""

    key: cache.KernelKey
    name: str
    config: dict[str, Any]
    source: str


# The per-process memos (the only mutable state here, and caches): request -> kernel, and an
# identity fast path (raw arguments with id(layer) -> layer, kernel), because hashing a 32-head
# LayerSpec costs ~9 us, a request ~11 us, and a repeated get_kernel must stay <= 10 us.
_BY_REQUEST: dict[KernelRequest, Any] = {}
_BY_ID: dict[tuple, tuple[LayerSpec, Any]] = {}


def forget() -> None:
    """Drop this process's kernels (both memos); the disk cache stays. Launchers that memoise
    loaded kernels themselves (the model kernels) drop theirs too."""
    from . import gluon_fallback

    _BY_REQUEST.clear()
    _BY_ID.clear()
    gluon_fallback.forget()
    for hook in _FORGET_HOOKS:
        hook()


_FORGET_HOOKS: list = []  # launchers' memo-clearing functions (`on_forget`)


def on_forget(hook) -> None:
    """Have `forget()` call `hook()` too (a launcher's own memo of loaded kernels)."""
    _FORGET_HOOKS.append(hook)


def key_of(request: KernelRequest) -> Keyed:
    """Render the request's source and compute its key (nothing is built or read)."""
    fam = family(request)
    name = fam.name(request)
    config = fam.config(request)
    try:
        source = fam.render(request)
    except RenderLimitError as exc:  # name the spec: the renderer knows only its constants
        spec = fam.spec_json(request)
        shown = spec if len(spec) <= 600 else f"{spec[:600]}... ({len(spec):,} characters)"
        raise RenderLimitError(f"kernel {name}: {exc}; spec {shown}", template=exc.template, limit=exc.limit,
                               spec=spec) from None  # fmt: skip
    key = cache.make_key(
        name,
        spec_json=fam.spec_json(request),
        template=source.encode(),  # the rendered source: template bytes + every Python constant
        arch=request.arch,
        extra=fam.key_extra(request, config),
    )
    return Keyed(key, name, config, source)


def lookup(request: KernelRequest) -> Lookup:
    """The kernel for `request`: memo, else disk, else build (see the module docstring)."""
    start = time.perf_counter()
    hit = _BY_REQUEST.get(request)
    if hit is not None:
        return Lookup(hit, "memory", time.perf_counter() - start)
    fam = family(request)
    keyed = key_of(request)
    key, name = keyed.key, keyed.name
    module_name = f"sparsegen_kernel_{key.digest[:24]}"

    def build():
        files = {fam.source_file: keyed.source.encode(), **fam.build(request, keyed.source, module_name)}
        meta = {"kind": request.kind, "variant": request.variant, "name": name, "arch": request.arch,
                "dtype": request.dtype, "config": keyed.config}  # fmt: skip
        if request.kind == "decode":
            meta["page_size"] = request.page_size
        if isinstance(request.params, AttentionParams) and request.params.knobs:
            meta["knobs"] = request.knobs
        if isinstance(request.params, AttentionParams) and request.params.kv_dtype:
            meta["kv_dtype"] = request.params.kv_dtype
        return files, meta

    def load(files: dict[str, Path]):
        return fam.load(request, files, key.key, files[fam.source_file].parent, module_name)

    found = cache.load_or_build(
        key, build, load, required=fam.required(request), label=f"{name} for {request.arch}"
    )
    _BY_REQUEST[request] = found.value
    return Lookup(found.value, found.status, time.perf_counter() - start)


def get(kind: str, layer, *, dtype, arch=None, page_size=None, variant=None, knobs=None,
        with_status: bool = False, kv_dtype=None):  # fmt: skip
    """`sparsegen.get_kernel`: the memoised getter. A repeat with the same layer object is one
    dict lookup on raw arguments (identity-checked); anything else builds a checked request. A
    Gluon prefill that `default_variant` chose may come back as the tl kernel (`gluon_fallback`)."""
    # The raw SPARSEGEN_PREFILL_TL value is part of the key: default_variant reads it.
    fast = (id(layer), kind, dtype, arch, page_size, variant, arch is None and env.interpreting(),
            os.environ.get("SPARSEGEN_PREFILL_TL"), checked_knobs(knobs), kv_dtype)  # fmt: skip
    try:
        hit = _BY_ID.get(fast)
    except TypeError:  # an unhashable argument (a list...): KernelRequest.make names it
        fast, hit = None, None
    if hit is not None and hit[0] is layer:
        return Lookup(hit[1], "memory", 0.0) if with_status else hit[1]
    request = KernelRequest.make(
        kind,
        layer,
        dtype=dtype,
        arch=arch,
        page_size=page_size,
        variant=variant,
        knobs=knobs,
        kv_dtype=kv_dtype,
    )
    if variant is None and request.variant == "gluon":  # chosen here: may fall back to tl
        from . import gluon_fallback

        found = gluon_fallback.lookup_defaulted(request, lookup)
    else:
        found = lookup(request)
    if fast is not None:
        _BY_ID[fast] = (layer, found.kernel)
    return found if with_status else found.kernel


__all__ = [
    "INTERPRETER_ARCH", "ArchError", "AttentionParams", "Family", "Kernel", "KernelRequest", "Keyed", "Lookup",
    "Request", "forget", "get", "key_of", "lookup", "on_forget", "register",
]  # fmt: skip
