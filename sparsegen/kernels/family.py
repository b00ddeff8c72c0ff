"""What a kernel family is made of, and nothing that runs one: the request a family reads, the
attention params, the `Kernel` and `Family` base classes and `register`. Every family module
(`kernels.families.*`) imports only this from the lifecycle's side; the lifecycle
(`kernels.base`: checked requests, memo, key, disk cache) sits above the families and imports
each family module by name on first use, and the launchers users import (`kernels.prefill`,
`kernels.decode`, `kernels.linear.*`, `kernels.fused.*`, `kernels.triton_kernel`) sit above it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ImplUnavailableError, InputError
from ..spec import LayerSpec

INTERPRETER_ARCH = "interpreter"  # pseudo-arch of kernels that run in Triton's interpreter


@dataclass(frozen=True)
class AttentionParams:
    """What decides an attention kernel besides dtype and arch."""

    layer: LayerSpec
    page_size: int  # decode: tokens per KV-cache page; prefill: 0
    knobs: tuple[tuple[str, int], ...] = ()  # sorted (name, value): settings beyond the defaults
    kv_dtype: str = ""  # the K/V element type when not q's: "fp8e4m3" / "fp8e5m2" (dtypes.FP8_NAMES)

    def to_json(self) -> str:
        return self.layer.to_json()

    def key_extra(self) -> dict[str, Any]:
        """Key fields besides the spec: page_size, and the knobs when there are any (so a default
        kernel's key is what it was before knobs existed)."""
        extra: dict[str, Any] = {"page_size": self.page_size}
        if self.knobs:
            extra["knobs"] = dict(self.knobs)
        if self.kv_dtype:  # only when set: a kernel over K/V of q's dtype keeps its key
            extra["kv_dtype"] = self.kv_dtype
        return extra


@dataclass(frozen=True)
class Request:
    """Everything that decides one kernel: what a family reads. The lifecycle builds them checked
    (`base.KernelRequest.make` / `.of`, a subclass that adds those constructors)."""

    kind: str  # one of KINDS or MODEL_KINDS
    params: Any  # the family's frozen params (AttentionParams for prefill / decode)
    dtype: str  # dtype name: "bf16" | "fp16" (| "fp32" in the interpreter)
    arch: str  # "sm_90", ... or INTERPRETER_ARCH
    variant: str  # a registered variant of the kind

    @property
    def layer(self) -> LayerSpec:
        return self.params.layer

    @property
    def page_size(self) -> int:
        return self.params.page_size

    @property
    def knobs(self) -> dict[str, int]:
        return dict(self.params.knobs)

    @property
    def kv_dtype(self) -> str:
        """'' (K/V of the request's dtype) or the fp8 KV dtype's name ("fp8e4m3")."""
        return getattr(self.params, "kv_dtype", "")


class Kernel(abc.ABC):
    """A built kernel for one request: `name`, `key`, `path`, `source`, `arch`; `launch` runs it.
    Immutable after construction (apart from caches of loaded GPU modules)."""

    def __init__(self, request: Request, key: str, name: str, path: Path, source: str) -> None:
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
    # The optional attention features (LayerSpec.features) and head dims this family's kernels
    # implement; a layer that needs anything else is refused before any render (check_layer).
    features: frozenset[str] = frozenset()
    head_dims: tuple[int, ...] = (64, 96, 128)
    kv_dtypes: frozenset[str] = frozenset()  # K/V dtypes besides q's that the kernels read ("fp8e4m3")

    def check_layer(self, request: Request) -> None:
        """Refuse an attention layer whose features or head_dim these kernels do not implement."""
        if not isinstance(request.params, AttentionParams):
            return
        layer = request.params.layer
        missing = [f for f in layer.features if f not in self.features]
        if missing:
            raise ImplUnavailableError(
                f"the {self.kind} kernels of variant {self.variant!r} do not implement {', '.join(missing)}; "
                "impl='reference' computes it"
            )
        kv = request.params.kv_dtype
        if kv and kv not in self.kv_dtypes:
            raise ImplUnavailableError(
                f"the {self.kind} kernels of variant {self.variant!r} do not read {kv} K/V"
                + (f" (they read {', '.join(sorted(self.kv_dtypes))})" if self.kv_dtypes else "")
                + "; impl='reference' computes it"
            )
        if layer.head_dim not in self.head_dims:
            raise ImplUnavailableError(
                f"the {self.kind} kernels of variant {self.variant!r} take head_dim {self.head_dims}, "
                f"not {layer.head_dim}; impl='reference' computes it"
            )

    def check(self, request: Request) -> None:
        """Refuse requests this family cannot build (typed errors); the default refuses knobs."""
        if isinstance(request.params, AttentionParams) and request.params.knobs:
            raise InputError(f"{self.kind} kernels of variant {self.variant!r} take no knobs, got "
                             f"{request.knobs}")  # fmt: skip

    def config(self, request: Request) -> dict[str, Any]:
        """Launch shape / tile sizes: ints only, pinned in the key."""
        return {}

    def spec_json(self, request: Request) -> str:
        """The canonical JSON of the request's params, hashed into the key."""
        return request.params.to_json()

    def key_extra(self, request: Request, config: dict[str, Any]) -> dict[str, Any]:
        """The key's fields besides the spec, the source, the arch and the toolchain."""
        return {"kind": request.kind, "variant": request.variant, "dtype": request.dtype, "config": config,
                **request.params.key_extra()}  # fmt: skip

    @abc.abstractmethod
    def name(self, request: Request) -> str:
        """Every family defines it."""

    @abc.abstractmethod
    def render(self, request: Request) -> str:
        """Every family defines it."""

    @abc.abstractmethod
    def build(self, request: Request, source: str, module_name: str) -> dict[str, bytes]:
        """The entry's files besides the source (compiled artefacts)."""

    def required(self, request: Request) -> tuple[str, ...]:
        """The files `load` needs (the cache rebuilds an entry lacking any of them)."""
        return (self.source_file,)

    @abc.abstractmethod
    def load(self, request: Request, files: dict[str, Path], key: str, path: Path, module_name: str):
        """Every family defines it."""


# The registered families by (kind, variant): filled as each family module is imported (a
# cache of what those imports made; `base.family` imports a missing one by name).
_FAMILIES: dict[tuple[str, str], Family] = {}


def register(fam: Family) -> Family:
    """Make `fam` the family of its (kind, variant); a family module ends with this call."""
    _FAMILIES[(fam.kind, fam.variant)] = fam
    return fam


def registered(kind: str, variant: str) -> Family | None:
    """The family registered for (kind, variant), or None while its module is not imported."""
    return _FAMILIES.get((kind, variant))


__all__ = ["INTERPRETER_ARCH", "AttentionParams", "Family", "Kernel", "Request", "register", "registered"]
