"""The few-row CUDA GEMM's family ("gemm_rows", variant "cuda"): a `Build` (shape, dtype, tile,
epilogue) is a request's params; rendered from templates/gemm_rows*.cu.jinja, compiled with
NVRTC for sm_90 and loaded once per device. The launcher (`gemm_rows(x, weight, ...)`, the
launch memo) is `kernels.linear.gemm_rows`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ... import dtypes
from ...env import parse_arch
from ...errors import CompileError, InputError
from ...jit import nvrtc_build as nb
from ...jit import render as jit_render
from ..family import Family, Kernel, Request, register
from ..linear.gemm_rows_tiles import Tile

KERNEL = "sparsegen_gemm_rows"
ARCH = "sm_90"
SOURCE_FILE = "kernel.cu"


@dataclass(frozen=True)
class Build:
    """Everything that decides one compiled kernel: the request's params."""

    n: int  # W rows
    k: int  # W columns
    dtype: str  # "bf16" | "fp16"
    tile: Tile
    has_bias: bool = True
    gegelu: bool = False  # the GeGeLU epilogue: [M, N / 2] out
    rope: tuple[int, int] | None = None  # (head_dim, group): the decode QKV epilogue (RopeWrite)
    skip_mma: bool = False  # benchmarks only (wrong results): the ring kernel streams its tiles, no math

    def check(self) -> None:
        """InputError for a tile that does not fit the shape or a bad epilogue."""
        self.tile.check(self.n, self.k)
        if self.gegelu and self.rope:
            raise InputError("gemm_rows: GeGeLU and rotary epilogues are exclusive")
        d, g = self.rope or (2, 1)
        if self.rope and (d & (d - 1) or self.tile.block_n % d or self.n % ((g + 2) * d)):
            raise InputError(f"gemm_rows rope: head_dim {d} must be a power of two dividing block_n "
                             f"({self.tile.block_n}) and N = {self.n} a multiple of (group + 2) * head_dim")  # fmt: skip

    def source(self) -> str:
        """The rendered CUDA source (checked first)."""
        self.check()
        d, g = self.rope or (2, 1)
        row = dtypes.resolve(self.dtype, kernel=True)
        t = self.tile
        return jit_render.render(
            t.template, n=self.n, k=self.k, dtype=row.name, ctype=row.ctype, block_n=t.block_n, block_k=t.block_k,
            split=t.split, stages=t.stages, has_bias=int(self.has_bias), gegelu=int(self.gegelu),
            rope=int(self.rope is not None), head_dim=d, group=g, rows_per_warp=t.rows_per_warp,
            skip_mma=int(self.skip_mma),
        )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def key_extra(self) -> dict:
        return {}


class GemmRowsKernel(Kernel):
    """The compiled kernel of one Build; `module(device)` loads it there once."""

    def __init__(self, request, key, name, path, source, cubin: bytes) -> None:
        super().__init__(request, key, name, path, source)
        self.cubin = cubin
        self._modules: dict[int, nb.CubinModule] = {}
        self._lock = threading.Lock()

    def module(self, device: torch.device) -> nb.CubinModule:
        mod = self._modules.get(device.index)
        if mod is None:
            with self._lock:
                mod = self._modules.get(device.index)
                if mod is None:
                    build = self.request.params
                    with torch.cuda.device(device):
                        mod = nb.CubinModule(self.cubin, (KERNEL,))
                        mod.allow_shared_memory(KERNEL, build.tile.smem_bytes(build.k))
                    self._modules[device.index] = mod
        return mod

    def launch(self, *args, **kwargs):
        raise InputError("launch a gemm_rows kernel through linear.gemm_rows.gemm_rows")


class GemmRowsFamily(Family):
    kind = "gemm_rows"
    variant = "cuda"
    source_file = SOURCE_FILE

    def check(self, request: Request) -> None:
        build = request.params
        if not isinstance(build, Build):
            raise InputError(f"gemm_rows kernels take a linear.gemm_rows.Build, got {type(build).__name__}")
        if parse_arch(request.arch) // 10 != 9:
            raise InputError(f"gemm_rows kernels are built for sm_90 (clusters, PDL), not {request.arch}")
        if request.dtype != build.dtype:
            raise InputError(
                f"gemm_rows: the request's dtype {request.dtype} is not the build's {build.dtype}"
            )
        build.check()

    def name(self, request: Request) -> str:
        b, t = request.params, request.params.tile
        tile = f"t{t.block_n}x{t.block_k}x{t.split}x{t.stages}" + (
            "_xres" if t.x_resident else f"_r{t.rows_per_warp}"
        )
        epilogue = "_gegelu" if b.gegelu else f"_rope{b.rope[0]}g{b.rope[1]}" if b.rope else ""
        flags = ("" if b.has_bias else "_nobias") + ("_skipmma" if b.skip_mma else "")
        return f"gemm_rows_{b.dtype}_n{b.n}_k{b.k}_{tile}{epilogue}{flags}"

    def render(self, request: Request) -> str:
        return request.params.source()

    def build(self, request: Request, source: str, module_name: str) -> dict[str, bytes]:
        cubin, _log = nb.compile_cubin(source, request.arch, name=f"{self.name(request)}.cu")
        return {"kernel.cubin": cubin}

    def required(self, request: Request) -> tuple[str, ...]:
        return (SOURCE_FILE, "kernel.cubin")

    def load(self, request, files: dict[str, Path], key: str, path: Path, module_name: str) -> GemmRowsKernel:
        try:
            source = files[SOURCE_FILE].read_text()
            cubin = files["kernel.cubin"].read_bytes()
        except (KeyError, OSError) as exc:
            raise CompileError(f"cache entry {key} is missing a file: {exc}") from None
        return GemmRowsKernel(request, key, self.name(request), path, source, cubin)


register(GemmRowsFamily())
