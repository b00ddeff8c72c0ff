"""The model's Triton kernels (GEMV, rotary + KV write, GeGeLU, add + LayerNorm) as families of
the one lifecycle: a request's `TritonParams`, the `TritonFamily` base of one family per
template (`families.model_triton`), and the `TritonKernel` it builds. The launcher that maps a
launch to its cached binary is `kernels.triton_kernel.TritonLauncher`.

Each template under `templates/` is a Python module holding one @triton.jit kernel, whose
runtime arguments come first and its `tl.constexpr` ones last. A request's `TritonParams` hold
what Triton's JIT would compile one binary for: the constexpr values, each runtime argument's
type and specialisation, and the compile options. The specialisation of an argument (a pointer
or int divisible by 16: "D"; an int equal to 1: the constant 1) is computed by Triton's own
`native_specialize_impl` (`specializer`), exactly as the JIT's binder does for every launch, so
the binaries cached here are the ones `kernel[grid](...)` would have compiled. The key covers
the rendered source (the template) and those params (`base.key_of`). Under TRITON_INTERPRET=1 a
request for the interpreter pseudo-arch loads the template's @triton.jit function, which runs
in Triton's interpreter.
"""

from __future__ import annotations

import abc
import functools
import json
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

from ... import env
from ...errors import ImplUnavailableError, InputError
from ...jit import render as jit_render
from ...jit import triton_build
from ..family import INTERPRETER_ARCH, Family, Kernel, Request, registered

SOURCE_FILE = "kernel.py"
OPTIONS = ("num_warps", "num_stages", "launch_pdl")  # the compile options a launcher may set


@dataclass(frozen=True)
class TritonParams:
    """What decides one binary of a template's kernel besides dtype and arch."""

    constexprs: tuple[tuple[str, Any], ...]  # (name, value) of each tl.constexpr argument, in order
    args: tuple[tuple[str, Any], ...]  # (Triton type, specialisation) of each runtime argument
    options: tuple[tuple[str, Any], ...]  # (name, value) of Triton compile options

    def to_json(self) -> str:
        return json.dumps(
            {"constexprs": self.constexprs, "args": self.args, "options": self.options},
            sort_keys=True,
            separators=(",", ":"),
        )

    def key_extra(self) -> dict[str, Any]:
        return {}


class TritonKernel(Kernel):
    """A template kernel built for one request: the interpreter's jit function, or the stored
    cubin + metadata, loaded as a `CompiledKernel` per device on first launch there."""

    def __init__(self, request, key, name, path, source, files: dict[str, Path], fn=None) -> None:
        super().__init__(request, key, name, path, source)
        self.files, self.fn = files, fn
        self._compiled: dict[int, Any] = {}

    def signature(self, fam: TritonFamily) -> dict[str, str]:
        types = {n: t for n, (t, _) in zip(fam.arg_names, self.request.params.args)}
        return {**types, **{n: "constexpr" for n in fam.constexpr_names}}

    def compiled(self, device: int):
        """The CompiledKernel on CUDA device `device` (loaded, its handles made, once per device)."""
        found = self._compiled.get(device)
        if found is None:
            if env.current_arch(device) != self.arch:
                raise ImplUnavailableError(
                    f"kernel {self.key} was compiled for {self.arch}; GPU {device} is {env.current_arch(device)}"
                )
            found = triton_build.load_compiled(
                self.files, self.signature(registered(self.request.kind, self.request.variant)), SOURCE_FILE
            )
            found._init_handles()
            self._compiled[device] = found
        return found

    def launch(self, grid, *args) -> None:
        """Launch on the current device and stream with `args` (runtime, then constexpr values)."""
        if self.fn is not None:
            self.fn[grid](*args)
            return
        active, runtime = triton_runtime()
        device = active.get_current_device()
        run_compiled(self.compiled(device), grid, active.get_current_stream(device), args, runtime)


def run_compiled(compiled, grid, stream, args, runtime) -> None:
    """What Triton's JIT does once it has the kernel: the launch, with its hooks
    (`runtime`: triton.knobs.runtime)."""
    enter = runtime.launch_enter_hook
    meta = compiled.launch_metadata(grid, stream, *args) if enter is not None else None
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, meta, enter,
                 runtime.launch_exit_hook, *args)  # fmt: skip


class TritonFamily(Family):
    """A template's kernel: subclasses set kind, template, fn_name, arg_names (runtime arguments
    in order), constexpr_names, do_not_specialize, and `describe` (the readable name's tail)."""

    variant = "triton"
    source_file = SOURCE_FILE
    template: str
    fn_name: str
    arg_names: tuple[str, ...]
    constexpr_names: tuple[str, ...]
    do_not_specialize: tuple[str, ...] = ()

    @abc.abstractmethod
    def describe(self, constexprs: dict[str, Any], options: dict[str, Any]) -> str:
        """The name after `<kind>_<dtype>_`: the constexprs that matter to a reader (each family's own)."""

    def check(self, request: Request) -> None:
        p = request.params
        if not isinstance(p, TritonParams):
            raise InputError(f"{self.kind} kernels take TritonParams, got {type(p).__name__}")
        if tuple(n for n, _ in p.constexprs) != self.constexpr_names:
            raise InputError(f"{self.kind}: constexprs must be {self.constexpr_names}, got {p.constexprs}")
        if request.arch != INTERPRETER_ARCH and len(p.args) != len(self.arg_names):
            raise InputError(f"{self.kind}: {len(self.arg_names)} runtime arguments, got {len(p.args)}")
        bad = [n for n, _ in p.options if n not in OPTIONS]
        if bad:
            raise InputError(f"{self.kind}: unknown compile options {bad}; known: {OPTIONS}")
        for name, value in p.constexprs + p.options:
            if not isinstance(value, (bool, int, float)):
                raise InputError(f"{self.kind}: {name} must be a bool, int or float, got {value!r}")

    def name(self, request: Request) -> str:
        p = request.params
        return f"{self.kind}_{request.dtype}_{self.describe(dict(p.constexprs), dict(p.options))}"

    def render(self, request: Request) -> str:
        return jit_render.render(self.template)

    def compile_inputs(self, request: Request) -> tuple[dict, dict, dict, dict]:
        """What `triton.compile(ASTSource(fn, signature, constexprs, attrs), options=...)` gets:
        (signature, constexprs by argument index, attrs by argument index, options), as Triton's
        JIT derives them from a launch (`JITFunction._pack_args`)."""
        p = request.params
        names = self.arg_names + self.constexpr_names
        signature = {n: t for n, (t, _) in zip(self.arg_names, p.args)}
        signature.update({n: "constexpr" for n in self.constexpr_names})
        constexprs = {i: spec for i, (t, spec) in enumerate(p.args) if t == "constexpr"}
        constexprs.update({names.index(n): v for n, v in p.constexprs})
        attrs = {i: _parse_attr(spec) for i, (t, spec) in enumerate(p.args) if isinstance(spec, str)}
        return signature, constexprs, attrs, dict(p.options)

    def build(self, request: Request, source: str, module_name: str) -> dict[str, bytes]:
        if request.arch == INTERPRETER_ARCH:
            return {}
        signature, constexprs, attrs, options = self.compile_inputs(request)
        return triton_build.aot_compile(
            source, fn_name=self.fn_name, signature=signature, arch=request.arch, options=options,
            module_name=module_name, source_file=SOURCE_FILE, constexprs=constexprs, attrs=attrs,
        )  # fmt: skip

    def required(self, request: Request) -> tuple[str, ...]:
        if request.arch == INTERPRETER_ARCH:
            return (SOURCE_FILE,)
        return (SOURCE_FILE, f"{self.fn_name}.cubin", f"{self.fn_name}.json")

    def load(self, request, files: dict[str, Path], key: str, path: Path, module_name: str) -> TritonKernel:
        source = files[SOURCE_FILE].read_text()
        fn = None
        if request.arch == INTERPRETER_ARCH:
            fn = triton_build.load_interpreted(
                files, module_name, fn_name=self.fn_name, source_file=SOURCE_FILE
            )
        return TritonKernel(request, key, self.name(request), path, source, dict(files), fn)


def _parse_attr(spec: str) -> list:
    """Triton's attribute list for a specialisation string (BaseBackend.parse_attr's rule)."""
    return [["tt.divisibility", 16]] if "D" in spec else []


@functools.cache
def specializer() -> tuple:
    """Triton's `native_specialize_impl` and the repeated arguments of its calls: (backend,
    is_const False, align True). The backend's rule (BaseBackend's get_tensor / get_int_
    specialization) is the same for every arch, so one sm_90 backend serves them all; no GPU
    is needed."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    return native_specialize_impl, repeat(backend), repeat(False), repeat(True)


@functools.cache
def triton_runtime() -> tuple:
    """Triton's active (CUDA) driver and its runtime knobs (launch hooks), fetched once."""
    from triton import knobs
    from triton.runtime import driver

    return driver.active, knobs.runtime


__all__ = ["TritonFamily", "TritonKernel", "TritonParams", "run_compiled", "specializer", "triton_runtime"]
