"""The one kernel lifecycle every family shares: request -> memo -> render -> key -> cache -> kernel.

    req = KernelRequest.make("prefill", layer, dtype=torch.bfloat16, arch="sm_90")
    found = lookup(req)              # Lookup(kernel, status, seconds); status beside the kernel
    found.kernel.name, found.kernel.key, found.kernel.path, found.kernel.source

A lookup walks one way: `lookup` memo (per process) -> the family renders the source for the
request -> `jit.cache.make_key` hashes that RENDERED source (so every input that decides the
source -- template bytes and the Python computing its constants -- is in the key) -> the disk
cache loads the entry or calls the family's `build` -> the family's `load` makes the kernel.

Families and variants. A family is one `Family` object per (kind, variant):

    kind      variant   module                      toolchain
    prefill   "tl"      sparsegen.kernels.prefill   Triton (`jit/triton_build.py`)
    decode    "cuda"    sparsegen.kernels.decode    NVRTC (`jit/nvrtc_build.py`)

A new variant of a kind (e.g. a Gluon prefill for sm_90, `variant="gluon"`) plugs in by:
  1. a module `sparsegen/kernels/<name>.py` defining a `Family` subclass with `kind`, `variant`,
     `check` (arches / dtypes / head dims it supports; raise InputError / ArchError),
     `config`, `name`, `render`, `build` and `load`, and a `Kernel` subclass with `launch`;
     the module ends with `register(TheFamily())`;
  2. one line in `FAMILY_MODULES` below, so `lookup` imports the module on first use;
  3. optionally a change to `default_variant`, the only place that picks a variant when the
     caller does not (today: "tl" for prefill, "cuda" for decode).
It then works through `sparsegen.get_kernel(layer, "prefill", dtype=..., variant="gluon")`,
`sparsegen compile` and the cache with no other change. Launch-time validation is shared:
`sparsegen.validate` checks every tensor once, with one alignment policy, before any family's
`launch` runs.
"""

from __future__ import annotations

import abc
import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import dtypes, env
from ..errors import ArchError, InputError
from ..jit import cache
from ..spec import LayerSpec

INTERPRETER_ARCH = "interpreter"  # pseudo-arch of kernels that run in Triton's interpreter
KINDS = ("prefill", "decode")
FAMILY_MODULES: dict[tuple[str, str], str] = {
    ("prefill", "tl"): "sparsegen.kernels.prefill",
    ("prefill", "gluon"): "sparsegen.kernels.prefill_gluon",
    ("decode", "cuda"): "sparsegen.kernels.decode",
}
DEFAULT_PAGE_SIZE = 16


def default_variant(kind: str, arch: str, layer: LayerSpec | None = None, dtype: str | None = None) -> str:
    """The variant used when the caller names none: for prefill on sm_90, the Gluon kernel
    whenever it covers the layer and dtype (SPARSEGEN_PREFILL_TL=1 keeps the tl kernel), else tl."""
    if kind != "prefill":
        return "cuda"
    if arch == "sm_90" and layer is not None and not env.flag("SPARSEGEN_PREFILL_TL"):
        from . import gluon_api, gluon_fallback, prefill_gluon_template

        missing = gluon_api.available()
        if missing is None and prefill_gluon_template.covers(layer, dtype) is None:
            return "gluon"
        if missing is not None:
            gluon_fallback.warn_once(f"the installed Triton has no usable Gluon ({missing})")
    return "tl"


@dataclass(frozen=True)
class KernelRequest:
    """Everything that decides one kernel. Build it with `make`, which checks every field."""

    kind: str  # "prefill" | "decode"
    layer: LayerSpec
    dtype: str  # dtype name: "bf16" | "fp16" (| "fp32" in the interpreter)
    arch: str  # "sm_90", ... or INTERPRETER_ARCH
    page_size: int  # decode: tokens per KV-cache page; prefill: 0
    variant: str  # "tl" (prefill), "cuda" (decode), or a registered variant

    @classmethod
    def make(cls, kind, layer, *, dtype, arch=None, page_size=None, variant=None) -> KernelRequest:
        """A checked request; `arch=None` means this GPU's, or the interpreter under TRITON_INTERPRET."""
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
        if not isinstance(variant, str) or (kind, variant) not in FAMILY_MODULES:
            known = sorted(v for k, v in FAMILY_MODULES if k == kind)
            raise InputError(f"variant must be one of {known} for {kind} kernels, got {variant!r}")
        request = cls(kind, layer, name, arch, page_size, variant)
        family(request).check(request)
        return request


class Kernel(abc.ABC):
    """A built kernel for one request: `name`, `key`, `path`, `source`, `arch`; `launch` runs it.
    Immutable after construction (apart from caches of loaded GPU modules)."""

    def __init__(self, request: KernelRequest, key: str, name: str, path: Path, source: str) -> None:
        self.request, self.key, self.name, self.path, self.source = request, key, name, Path(path), source

    @property
    def layer(self) -> LayerSpec:
        return self.request.layer

    @property
    def arch(self) -> str:
        return self.request.arch

    @property
    def dtype_name(self) -> str:
        return self.request.dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key}, arch={self.arch})"

    @abc.abstractmethod
    def launch(self, *args, **kwargs):
        """Run on the current stream; inputs already validated (each family's own signature)."""


class Family(abc.ABC):
    """One (kind, variant): how to name, render, build and load its kernels."""

    kind: str
    variant: str
    source_file: str

    def check(self, request: KernelRequest) -> None:
        """Refuse requests this family cannot build (typed errors); the default accepts all."""
        return None

    def config(self, request: KernelRequest) -> dict[str, Any]:
        """Launch shape / tile sizes: ints only, pinned in the key."""
        return {}

    @abc.abstractmethod
    def name(self, request: KernelRequest) -> str:
        """Every family defines it."""

    @abc.abstractmethod
    def render(self, request: KernelRequest) -> str:
        """Every family defines it."""

    @abc.abstractmethod
    def build(self, request: KernelRequest, source: str, module_name: str) -> dict[str, bytes]:
        """The entry's files besides the source (compiled artefacts)."""

    def required(self, request: KernelRequest) -> tuple[str, ...]:
        """The files `load` needs (the cache rebuilds an entry lacking any of them)."""
        return (self.source_file,)

    @abc.abstractmethod
    def load(self, request: KernelRequest, files: dict[str, Path], key: str, path: Path, module_name: str):
        """Every family defines it."""


_FAMILIES: dict[tuple[str, str], Family] = {}


def register(fam: Family) -> Family:
    _FAMILIES[(fam.kind, fam.variant)] = fam
    return fam


def family(request: KernelRequest) -> Family:
    key = (request.kind, request.variant)
    fam = _FAMILIES.get(key)
    if fam is None:
        importlib.import_module(FAMILY_MODULES[key])
        fam = _FAMILIES[key]
    return fam


@dataclass(frozen=True)
class Lookup:
    """A kernel and how this lookup found it: "memory" (this process had it), "cached" (read from
    disk) or "compiled" (built now); `seconds` is what this lookup took."""

    kernel: Any
    status: str
    seconds: float


# The per-process memos (the only mutable state here, and caches): request -> kernel, and an
# identity fast path (raw arguments with id(layer) -> layer, kernel), because hashing a 32-head
# LayerSpec costs ~9 us, a request ~11 us, and a repeated get_kernel must stay <= 10 us.
_BY_REQUEST: dict[KernelRequest, Any] = {}
_BY_ID: dict[tuple, tuple[LayerSpec, Any]] = {}


def forget() -> None:
    """Drop this process's kernels (both memos, and the Gluon builds that failed); the disk cache stays."""
    from . import gluon_fallback

    _BY_REQUEST.clear()
    _BY_ID.clear()
    gluon_fallback.forget()


def lookup(request: KernelRequest) -> Lookup:
    """The kernel for `request`: memo, else disk, else build (see the module docstring)."""
    start = time.perf_counter()
    hit = _BY_REQUEST.get(request)
    if hit is not None:
        return Lookup(hit, "memory", time.perf_counter() - start)
    fam = family(request)
    name = fam.name(request)
    config = fam.config(request)
    source = fam.render(request)
    key = cache.make_key(
        name,
        spec_json=request.layer.to_json(),
        template=source.encode(),  # the rendered source: template bytes + every Python constant
        arch=request.arch,
        extra={"kind": request.kind, "variant": request.variant, "dtype": request.dtype,
               "page_size": request.page_size, "config": config},
    )  # fmt: skip
    module_name = f"sparsegen_kernel_{key.digest[:24]}"

    def build():
        files = {fam.source_file: source.encode(), **fam.build(request, source, module_name)}
        meta = {"kind": request.kind, "variant": request.variant, "name": name, "arch": request.arch,
                "dtype": request.dtype, "config": config}  # fmt: skip
        if request.kind == "decode":
            meta["page_size"] = request.page_size
        return files, meta

    def load(files: dict[str, Path]):
        return fam.load(request, files, key.key, files[fam.source_file].parent, module_name)

    found = cache.load_or_build(
        key, build, load, required=fam.required(request), label=f"{name} for {request.arch}"
    )
    _BY_REQUEST[request] = found.value
    return Lookup(found.value, found.status, time.perf_counter() - start)


def get(kind: str, layer, *, dtype, arch=None, page_size=None, variant=None, with_status: bool = False):
    """`sparsegen.get_kernel`: the memoised getter. A repeat with the same layer object is one
    dict lookup on raw arguments (identity-checked); anything else builds a checked request. A
    Gluon prefill that `default_variant` chose may come back as the tl kernel (`gluon_fallback`)."""
    # The raw SPARSEGEN_PREFILL_TL value is part of the key: default_variant reads it.
    fast = (id(layer), kind, dtype, arch, page_size, variant, arch is None and env.interpreting(),
            os.environ.get("SPARSEGEN_PREFILL_TL"))  # fmt: skip
    try:
        hit = _BY_ID.get(fast)
    except TypeError:  # an unhashable argument (a list...): KernelRequest.make names it
        fast, hit = None, None
    if hit is not None and hit[0] is layer:
        return Lookup(hit[1], "memory", 0.0) if with_status else hit[1]
    request = KernelRequest.make(kind, layer, dtype=dtype, arch=arch, page_size=page_size, variant=variant)
    if variant is None and request.variant == "gluon":  # chosen here: may fall back to tl
        from . import gluon_fallback

        found = gluon_fallback.lookup_defaulted(request, lookup)
    else:
        found = lookup(request)
    if fast is not None:
        _BY_ID[fast] = (layer, found.kernel)
    return found if with_status else found.kernel


__all__ = ["ArchError", "Family", "Kernel", "KernelRequest", "Lookup", "forget", "get", "lookup", "register"]
