"""CUDA C++ -> cubin with NVRTC (through cuda-core), and cubin -> launchable kernels.

NVRTC needs no GPU: it compiles for an explicit arch (`sm_80`, `sm_90`, ...). It has no default
include path, so `cuda_include_dir()` finds a directory holding `cuda_fp16.h` and `cuda_bf16.h`:

    $SPARSEGEN_CUDA_INCLUDE, cuda.pathfinder's CUDA headers, $CUDA_HOME / $CUDA_PATH,
    /usr/local/cuda*/include, then the copy shipped in Triton's wheel.
"""

from __future__ import annotations

import functools
import glob
import os
import threading
from pathlib import Path

from .. import env
from ..env import parse_arch
from ..errors import CompileError
from .compile_errors import nvrtc_cause

_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")


def _has_headers(path: str | os.PathLike | None) -> bool:
    return bool(path) and all((Path(path) / h).is_file() for h in _HEADERS)


def _candidate_include_dirs() -> list[str]:
    out: list[str] = []
    explicit = env.path("SPARSEGEN_CUDA_INCLUDE")
    if explicit is not None:
        out.append(str(explicit))
    try:  # cuda-pathfinder knows the pip wheels (nvidia-cuda-runtime...) and conda layouts
        from cuda.pathfinder import find_nvidia_header_directory

        for lib in ("cudart", "nvrtc"):
            try:
                found = find_nvidia_header_directory(lib)
            except Exception:  # noqa: BLE001 - an unknown lib name or a missing package
                found = None
            if found:
                out.append(str(found))
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append(os.path.join(os.environ[var], "include"))
    out.append("/usr/local/cuda/include")
    out.extend(sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True))
    try:
        import triton

        out.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
    except ImportError:
        pass
    return out


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """A directory with cuda_fp16.h and cuda_bf16.h, or CompileError listing where it looked."""
    candidates = _candidate_include_dirs()
    for path in candidates:
        if _has_headers(path):
            return str(path)
    raise CompileError(
        "NVRTC needs cuda_fp16.h and cuda_bf16.h but none of these directories has them: "
        f"{candidates}; set SPARSEGEN_CUDA_INCLUDE to a CUDA toolkit's include/ directory"
    )


_CORE_NAMES = ("Device", "LaunchConfig", "ObjectCode", "Program", "ProgramOptions", "Stream", "launch")
_CORE_IMPORT = threading.Lock()


@functools.cache
def _core():
    """cuda.core, imported once under a lock: its names load lazily, and threads that build
    kernels side by side (compile, fuzz) once saw a half-loaded module (no ProgramOptions)."""
    with _CORE_IMPORT:
        try:
            import cuda.core as core

            for name in _CORE_NAMES:
                getattr(core, name)
        except (ImportError, AttributeError) as exc:
            raise CompileError(
                f"compiling CUDA kernels needs cuda-core and NVRTC (pip install 'sparsegen[cuda]'): {exc}"
            ) from None
    return core


def compile_cubin(source: str, arch: str, *, name: str = "sparsegen") -> tuple[bytes, str]:
    """Compile CUDA C++ to a cubin for `arch`; returns (cubin, compile log). Any warning in the
    log is a CompileError."""
    parse_arch(arch)
    core = _core()
    include = cuda_include_dir()
    options = core.ProgramOptions(
        name=name, arch=arch, std="c++17", include_path=[include], use_fast_math=False, ftz=False
    )

    class _Log:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> None:
            self.text += text

    log = _Log()
    try:
        program = core.Program(source, "c++", options)
        obj = program.compile("cubin", logs=log)
    except Exception as exc:  # noqa: BLE001 - NVRTC errors come as several exception types
        output = f"{exc}\n{log.text}".replace("\x00", "")  # cuda-core puts the log in the exception
        raise CompileError(
            f"NVRTC failed to compile {name} for {arch}: {nvrtc_cause(output)}\n\n{output.strip()}"
        ) from None
    if "warning" in log.text.lower():  # warnings are errors: a rendered kernel must compile cleanly
        output = log.text.replace("\x00", "").strip()
        raise CompileError(
            f"NVRTC warned while compiling {name} for {arch} (warnings are errors): "
            f"{nvrtc_cause(output, 'warning')}\n\n{output}"
        )
    return bytes(obj.code), log.text


class CubinModule:
    """A loaded cubin: kernels by name, launched on a given torch stream."""

    def __init__(self, cubin: bytes, kernel_names: tuple[str, ...]) -> None:
        import torch

        core = _core()
        self._core = core
        device = core.Device(torch.cuda.current_device())
        device.set_current()
        self._obj = core.ObjectCode.from_cubin(cubin)
        self.kernels = {n: self._obj.get_kernel(n) for n in kernel_names}
        self._streams: dict[int, object] = {}

    def stream(self, handle: int):
        """A cuda-core Stream for a raw cudaStream_t (torch's current stream), memoised."""
        s = self._streams.get(handle)
        if s is None:
            s = self._core.Stream.from_handle(handle)
            self._streams[handle] = s
        return s

    def allow_shared_memory(self, name: str, nbytes: int) -> None:
        """Let kernel `name` take `nbytes` of dynamic shared memory (above 48 KB a launch needs
        this attribute set first); CompileError if the driver refuses."""
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = self.kernels[name].handle
        if isinstance(handle, driver.CUkernel):  # a library kernel: the attribute is per device
            import torch

            (err,) = driver.cuKernelSetAttribute(attr, int(nbytes), handle, torch.cuda.current_device())
        else:
            (err,) = driver.cuFuncSetAttribute(handle, attr, int(nbytes))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CompileError(f"the driver refused {nbytes} B of dynamic shared memory for {name}: {err}")

    def launch(
        self,
        name: str,
        stream_handle: int,
        grid,
        block,
        *args,
        pdl: bool = False,
        cluster=None,
        shmem: int = 0,
    ) -> None:
        """`pdl`: launch with programmatic stream serialization (sm_90+): the kernel may start
        before the one before it on the stream has finished, and must wait for it itself.
        `cluster`: blocks per thread-block cluster (sm_90+); `grid` then counts clusters.
        `shmem`: bytes of dynamic shared memory per block."""
        config = self._core.LaunchConfig(
            grid=grid, cluster=cluster, block=block, shmem_size=shmem, programmatic_stream_serialization=pdl
        )
        self._core.launch(self.stream(stream_handle), config, self.kernels[name], *args)
