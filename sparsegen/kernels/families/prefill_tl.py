"""Triton block-sparse prefill, variant "tl": the family that builds, loads and launches it.

    kernel = sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16)   # built once, cached
    out = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k)                        # [Tq, H, D]

The template and its constants live in `kernels/prefill_template.py`; the Triton toolchain in
`jit/triton_build.py`; the lifecycle (request, memo, key, cache) in `kernels/base.py`, and the
getters (`get_prefill_kernel`, `precompile`) in `kernels/prefill.py`. On a GPU the
kernel is compiled ahead of time for its arch and loaded from the cached cubin. Under
TRITON_INTERPRET=1 the rendered @triton.jit function runs in Triton's interpreter. Without a
GPU, `arch=` compiles for that arch: the kernel can be stored and inspected, not run.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton

from ... import dtypes, env
from ...errors import ImplUnavailableError, InputError
from ...jit import triton_build
from ...validate import check_cu_seqlens_values, check_prefill_inputs, layer_scale
from .. import prefill_template as tpl
from ..family import INTERPRETER_ARCH, Family, Kernel, Request, register

LOG2E = 1.4426950408889634


class PrefillKernel(Kernel):
    """A compiled prefill kernel for one request; call it like `sparsegen.prefill`."""

    def __init__(self, request, key, name, path, source, config, entry) -> None:
        super().__init__(request, key, name, path, source)
        self.config = config
        self._entry = entry  # CompiledKernel (GPU), jit function (interpreter), or files (AOT)

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.resolve(self.request.dtype).torch

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, layer=None, scale=None, *, check=True,
                 max_seqlen_q=None, max_seqlen_k=None, sinks=None):  # fmt: skip
        """q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D]; validates, then launches. `sinks`
        ([H] float32) exactly when the layer has learned sinks."""
        if layer is not None and layer is not self.layer and layer != self.layer:
            raise InputError("layer differs from the spec this kernel was compiled for")
        check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, self.layer,
                             allow_cpu=self.arch == INTERPRETER_ARCH, kernel=True, check_values=False,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **_sinks(sinks))  # fmt: skip
        self.check_target(q)
        scale = layer_scale(scale, self.layer)
        launch = self.prepare(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_k=max_seqlen_k, **_sinks(sinks)
        )
        if check:  # the device sync last (see prepare)
            check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)  # fmt: skip
        return launch()

    def check_target(self, q: torch.Tensor) -> None:
        interp = self.arch == INTERPRETER_ARCH
        if q.dtype != self.dtype and not interp:
            raise InputError(f"q has dtype {q.dtype}, but this kernel was compiled for {self.dtype}")
        if not interp:
            if q.device.type != "cuda":
                raise InputError(f"q must be on a CUDA device for the compiled kernel, got {q.device}")
            here = env.current_arch(q.device)
            if here != self.arch:
                raise InputError(f"q is on an {here} GPU, but this kernel was compiled for {self.arch}")

    def launch(self, q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, *, max_seqlen_k=None,
               sinks=None) -> torch.Tensor:  # fmt: skip
        """Launch on the current stream; inputs already validated (validate.check_prefill_inputs)."""
        return self.prepare(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_k=max_seqlen_k, **_sinks(sinks)
        )()

    def prepare(self, q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, *, max_seqlen_k=None,
                sinks=None) -> Launch:  # fmt: skip
        """Every host-side step of a launch but the launch itself: the output, grid and arguments.
        `sparsegen.prefill` reads cu_seqlens on the host (a device sync) between this and the call,
        so that the GPU waits only for the launch after the sync. `sinks`: [H] float32, checked
        (validate.check_features), present exactly when the layer has learned sinks."""
        if (sinks is not None) != self.layer.learned_sinks:
            raise InputError(f"sinks= must be given exactly when the layer has learned_sinks "
                             f"(learned_sinks={self.layer.learned_sinks})")  # fmt: skip
        poison = env.flag("SPARSEGEN_POISON_OUTPUT")  # NaN-filled outputs show unwritten rows
        out = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)  # [Tq, H, D]
        # Tk (or max_seqlen_k) bounds every sequence's k_len: no device sync; extra tiles exit at once.
        longest = k.shape[0] if max_seqlen_k is None else min(int(max_seqlen_k), k.shape[0])
        pack = self.config.get("pack", 1)  # query heads per program (narrow windows, GQA)
        n_tiles = triton.cdiv(longest, self.config["block_m"] // pack)
        if q.shape[0] == 0 or n_tiles == 0:
            return Launch(out)
        grid = ((cu_seqlens_q.shape[0] - 1) * (self.layer.num_heads // pack), n_tiles, 1)
        feature_args = (sinks,) if self.layer.learned_sinks else ()
        args = (
            q, k, v, out, *feature_args, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), n_tiles,
        )  # fmt: skip
        if self.arch == INTERPRETER_ARCH:
            return Launch(out, self._entry[grid], args)
        return Launch(out, self._compiled()[grid], args, q.device)

    def _compiled(self):
        """The loaded kernel; an AOT entry for another arch has only its files."""
        if isinstance(self._entry, dict):
            raise ImplUnavailableError(
                f"kernel {self.key} was compiled ahead of time for {self.arch}; it runs only on a GPU of that arch"
            )
        return self._entry


def _sinks(sinks) -> dict:
    """sinks= for `prepare` only when given (a layer without learned sinks takes none)."""
    return {} if sinks is None else {"sinks": sinks}


class Launch:
    """A prepared launch (`PrefillKernel.prepare`): calling it launches `fn(*args)` on the current
    stream of `device` (None: Triton's interpreter) and returns `out`; with no `fn` there is
    nothing to compute (an empty batch) and it returns `out` at once."""

    __slots__ = ("out", "fn", "args", "device")

    def __init__(
        self, out: torch.Tensor, fn=None, args: tuple = (), device: torch.device | None = None
    ) -> None:
        self.out, self.fn, self.args, self.device = out, fn, args, device  # out: [Tq, H, D]

    def __call__(self) -> torch.Tensor:
        if self.fn is None:
            return self.out
        if self.device is None:
            self.fn(*self.args)
            return self.out
        index = self.device.index  # a CUDA tensor's device always names its index
        stream = torch.cuda.current_stream(index).cuda_stream
        if index == torch.cuda.current_device():
            self.fn(*self.args, stream=stream)
        else:
            with torch.cuda.device(index):
                self.fn(*self.args, stream=stream)
        return self.out


class TritonPrefill(Family):
    kind = "prefill"
    variant = "tl"
    source_file = tpl.SOURCE_FILE
    features = tpl.FEATURES
    head_dims = tpl.HEAD_DIMS

    def check(self, request: Request) -> None:
        super().check(request)  # the tl kernel takes no knobs
        if request.dtype == "bf16" and request.arch == INTERPRETER_ARCH:
            raise ImplUnavailableError(
                "Triton's interpreter computes tl.dot on bf16 wrongly; run it in fp16 or fp32, "
                "and bf16 on a GPU"
            )
        if request.dtype == "fp32" and request.arch != INTERPRETER_ARCH:
            raise InputError(
                "dtype fp32 runs only in Triton's interpreter; compiled kernels take fp16 or bf16"
            )

    def config(self, request: Request) -> dict[str, int]:
        config = tpl.pick_config(request.dtype, request.layer.head_dim, request.arch)
        return tpl.narrow_config(request.layer, config, request.arch)

    def name(self, request: Request) -> str:
        return tpl.kernel_name(request.layer, request.dtype, request.variant)

    def render(self, request: Request) -> str:
        return tpl.render_source(request.layer, self.config(request))

    def build(self, request: Request, source: str, module_name: str) -> dict[str, bytes]:
        if request.arch == INTERPRETER_ARCH:
            return {}
        config = self.config(request)
        options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        if "maxnreg" in config:  # a register cap lets more programs share a multiprocessor
            options["maxnreg"] = config["maxnreg"]
        return triton_build.aot_compile(
            source, fn_name=tpl.KERNEL_FN, signature=tpl.signature(request.dtype, request.layer.learned_sinks), aligned=tpl.ALIGNED_ARGS,
            arch=request.arch, options=options, module_name=module_name, source_file=tpl.SOURCE_FILE,
        )  # fmt: skip

    def required(self, request: Request) -> tuple[str, ...]:
        if request.arch == INTERPRETER_ARCH:
            return (tpl.SOURCE_FILE,)
        return (tpl.SOURCE_FILE, f"{tpl.KERNEL_FN}.cubin", f"{tpl.KERNEL_FN}.json")

    def load(self, request, files: dict[str, Path], key: str, path: Path, module_name: str) -> PrefillKernel:
        source = files[tpl.SOURCE_FILE].read_text()
        if request.arch == INTERPRETER_ARCH:
            entry = triton_build.load_interpreted(files, module_name, fn_name=tpl.KERNEL_FN,
                                                  source_file=tpl.SOURCE_FILE)  # fmt: skip
        elif env.current_arch() != request.arch:
            entry = dict(files)  # compiled ahead of time for another arch: keep the files only
        else:
            entry = triton_build.load_compiled(files, tpl.signature(request.dtype, request.layer.learned_sinks),
                                              tpl.SOURCE_FILE)  # fmt: skip
        return PrefillKernel(request, key, self.name(request), path, source, self.config(request), entry)


register(TritonPrefill())
