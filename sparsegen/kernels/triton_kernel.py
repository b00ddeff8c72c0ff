"""The launcher of the model's Triton kernels: maps a launch to its cached binary through the
lifecycle (`kernels.base`), one per family (`families.model_triton`).

    LAUNCH = TritonLauncher(GEMV)                    # one per kernel, at import of its module
    LAUNCH(grid, args, constexprs, options, "bf16")  # args: runtime arguments in order

The hot path of a launch is the arguments' specialisation (Triton's `native_specialize_impl`,
as `families.triton` describes), one dict lookup (device, constexprs, options, specialisation)
-> the loaded `CompiledKernel`, and its launcher: the JIT's own path without its argument
binding, option string and cache key. A miss goes through `base.lookup` (memo, disk, build;
refused under SPARSEGEN_DISABLE_JIT). `TritonLauncher.request` makes the same request for a
launch described by meta tensors (`sparsegen compile --model-kernels`: ahead of time, no GPU).
"""

from __future__ import annotations

from typing import Any

from .. import dtypes, env
from ..errors import ImplUnavailableError
from . import base
from .base import KernelRequest
from .families.triton import (
    TritonFamily,
    TritonKernel,
    TritonParams,
    run_compiled,
    specializer,
    triton_runtime,
)
from .family import INTERPRETER_ARCH


class TritonLauncher:
    """The per-process memo between a launch and its loaded binary (a cache, cleared by
    `base.forget`), for one family."""

    def __init__(self, fam: TritonFamily) -> None:
        self.family = fam  # registered by its module (families.model_triton)
        self._flags = tuple(n not in fam.do_not_specialize for n in fam.arg_names)
        self._loaded: dict[tuple, Any] = {}
        self._impl = (
            None  # specializer() + triton_runtime(), fetched at the first launch (they import Triton)
        )
        base.on_forget(self._loaded.clear)

    def spec(self, args: tuple) -> tuple:
        """(type, specialisation) of each runtime argument, as Triton's JIT computes them."""
        impl, backend, no, yes = specializer()
        return tuple(map(impl, backend, args, no, self._flags, yes))

    def request(self, args, constexprs: tuple, options: tuple, dtype, arch: str) -> KernelRequest:
        """The request of a launch with these arguments for `arch` (meta tensors do: no data is
        read); `dtype` (a torch dtype or its name) names the kernel."""
        dtype = dtypes.name(dtype)
        spec = () if arch == INTERPRETER_ARCH else self.spec(tuple(args))
        names = zip(self.family.constexpr_names, constexprs)
        params = TritonParams(tuple(names), spec, tuple(options))
        return KernelRequest.of(self.family.kind, params, dtype=dtype, arch=arch, variant=self.family.variant)

    def __call__(self, grid, args: tuple, constexprs: tuple, options: tuple, dtype: str) -> None:
        """Launch on the current device and stream: grid (3 ints), runtime args, constexpr values
        (in the family's order), ((option, value), ...), the torch dtype that names the kernel."""
        if env.interpreting():
            self._interpret(grid, args, constexprs, options, dtype)
            return
        if self._impl is None:
            self._impl = specializer() + triton_runtime()
        impl, backend, no, yes, active, runtime = self._impl
        device = active.get_current_device()
        spec = tuple(map(impl, backend, args, no, self._flags, yes))
        memo = (device, constexprs, options, spec)
        compiled = self._loaded.get(memo)
        if compiled is None:
            arch = env.current_arch(device)
            if arch is None:
                raise ImplUnavailableError(
                    f"the {self.family.kind} kernel needs a CUDA GPU (or TRITON_INTERPRET=1)"
                )
            kernel = base.lookup(self.request(args, constexprs, options, dtype, arch)).kernel
            compiled = self._loaded[memo] = kernel.compiled(device)
        run_compiled(compiled, grid, active.get_current_stream(device), args + constexprs, runtime)

    def _interpret(self, grid, args, constexprs, options, dtype) -> None:
        memo = ("interpreter", constexprs, options, dtype)
        fn = self._loaded.get(memo)
        if fn is None:
            fn = self._loaded[memo] = base.lookup(
                self.request(args, constexprs, (), dtype, INTERPRETER_ARCH)
            ).kernel.fn
        fn[grid](*args, *constexprs, **dict(options))


__all__ = ["TritonFamily", "TritonKernel", "TritonLauncher", "TritonParams"]
