"""Triton block-sparse prefill: fetch the kernel for a layer spec, validate inputs, launch.

    kernel = get_prefill_kernel(layer, dtype=torch.bfloat16)       # compiled once, then cached
    out = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, layer)        # q: [Tq, H, D] -> [Tq, H, D]

On a GPU the kernel is compiled ahead of time for its arch and loaded from the cache's cubin.
Under TRITON_INTERPRET=1 the rendered @triton.jit function runs in Triton's interpreter.
Without a GPU, `arch=` compiles for that arch: the kernel can be stored and inspected, not run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from .. import dtypes, env
from ..codegen import template_bytes
from ..errors import ImplUnavailableError, InputError
from ..jit import cache, triton_build
from ..spec import LayerSpec
from ..validate import check_prefill_inputs, softmax_scale

LOG2E = 1.4426950408889634
DTYPE_NAMES = {d.torch: d.name for d in dtypes.TABLE}  # torch.bfloat16 -> "bf16"

# Per-process memo: (id(layer), dtype, arch) -> (layer, kernel); the layer is kept alive and
# compared by identity, so a repeated get_kernel costs a dict lookup.
_MEMO: dict[tuple, tuple[LayerSpec, PrefillKernel]] = {}
_MEMO_BY_VALUE: dict[tuple, PrefillKernel] = {}


_interpreting = env.interpreting
current_arch = env.current_arch


def _poisoning() -> bool:
    """SPARSEGEN_POISON_OUTPUT=1 fills outputs with NaN before launch (tests catch unwritten rows)."""
    return env.flag("SPARSEGEN_POISON_OUTPUT")


def kernel_name(layer: LayerSpec, dtype: str) -> str:
    """Readable half of the key, e.g. prefill_bf16_hd128_h32kv8_bs64_l16_v8."""
    base = f"prefill_{dtype}_hd{layer.head_dim}_h{layer.num_heads}kv{layer.num_kv_heads}"
    distinct = {(h.kind, h.block_size, h.local_blocks, h.vert_stride, h.sliding_window) for h in layer.heads}
    if len(distinct) > 1:
        return f"{base}_hybrid{len(distinct)}"
    head = layer.heads[0]
    if head.dense:
        return f"{base}_dense"
    parts = [f"bs{head.block_size}"]
    parts += [f"l{head.local_blocks}"] if head.local_blocks else []
    parts += [f"v{head.vert_stride}"] if head.vert_stride else []
    parts += [f"w{head.sliding_window}"] if head.sliding_window else []
    return "_".join([base, *parts])


@dataclass
class PrefillKernel:
    """A compiled prefill kernel for one layer spec, dtype and arch; call it like `prefill`."""

    layer: LayerSpec
    dtype: torch.dtype
    arch: str
    config: dict[str, int]
    name: str
    key: str
    path: Path
    status: str  # "compiled" | "cached" (how the first lookup in this process found it)
    seconds: float
    _entry: Any = field(repr=False, default=None)  # CompiledKernel (GPU), jit fn (interpreter), files (AOT)
    _launch: Any = field(repr=False, default=None)

    @property
    def source(self) -> str:
        """The rendered Triton module."""
        return (self.path / triton_build.SOURCE_FILE).read_text()

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, layer=None, scale=None, *, check=True):
        """q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D]. check=False skips reading cu_seqlens'
        values on the host (no device sync); dtypes, devices, shapes and strides are still checked."""
        if layer is not None and layer is not self.layer and layer != self.layer:
            raise InputError("layer differs from the spec this kernel was compiled for")
        interp = self.arch == triton_build.INTERPRETER_ARCH
        if check:
            check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, self.layer, allow_cpu=interp)
        else:
            _check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, self.layer)
        self._check_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, interp)
        q, k, v = (_aligned(t) for t in (q, k, v))  # q: [Tq, H, D]; k, v: [Tk, Hkv, D]
        scale = softmax_scale(scale, self.layer.head_dim)
        out = torch.full_like(q, float("nan")) if _poisoning() else torch.empty_like(q)  # [Tq, H, D]
        if q.shape[0] == 0:
            return out
        # Tk bounds every sequence's k_len: the grid needs no device sync; extra tiles exit at once.
        n_tiles = triton.cdiv(k.shape[0], self.config["block_m"])
        if n_tiles == 0:
            return out
        grid = ((cu_seqlens_q.shape[0] - 1) * self.layer.num_heads, n_tiles, 1)
        args = (
            q, k, v, out, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), n_tiles,
        )  # fmt: skip
        if interp:
            self._entry[grid](*args)
            return out
        compiled = self._compiled()
        with torch.cuda.device(q.device):
            stream = torch.cuda.current_stream(q.device).cuda_stream
            compiled[grid](*args, stream=stream)
        return out

    def _check_tensors(self, q, k, v, cu_q, cu_k, interp: bool) -> None:
        want = self.dtype
        if q.dtype != want and not (interp and q.dtype in DTYPE_NAMES):
            raise InputError(f"q has dtype {q.dtype}, but this kernel was compiled for {want}")
        if not interp:
            if q.device.type != "cuda":
                raise InputError(f"q must be on a CUDA device for the compiled kernel, got {q.device}")
            cc = torch.cuda.get_device_capability(q.device)
            if f"sm_{cc[0]}{cc[1]}" != self.arch:
                raise InputError(
                    f"q is on an sm_{cc[0]}{cc[1]} GPU, but this kernel was compiled for {self.arch}"
                )
        for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if t.device != q.device:
                raise InputError(f"{name} is on {t.device} but q is on {q.device}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(2) != 1:
                raise InputError(
                    f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}"
                )

    def _compiled(self):
        if self._launch is None:
            if self.arch == triton_build.INTERPRETER_ARCH or isinstance(self._entry, dict):
                raise ImplUnavailableError(
                    f"kernel {self.key} was compiled ahead of time for {self.arch}; "
                    "it runs only on a GPU of that arch"
                )
            self._launch = self._entry
        return self._launch


def _check_shapes(q, k, v, cu_q, cu_k, layer: LayerSpec) -> None:
    """The checks that need no tensor values (check=False)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if q.dim() != 3 or q.shape[1:] != (h, d):
        raise InputError(f"q must be [Tq, {h}, {d}] for this layer, got {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[1:] != (hkv, d) or v.shape != k.shape:
        raise InputError(f"k and v must be [Tk, {hkv}, {d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape != cu_q.shape or t.shape[0] < 2:
            raise InputError(f"{name} must be int32 [B+1] like cu_seqlens_q, got {t.dtype} {tuple(t.shape)}")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The kernel is compiled for 16-byte-aligned pointers and strides divisible by 16."""
    if t.data_ptr() % 16 or t.stride(0) % 16 or t.stride(1) % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def _lookup(layer: LayerSpec, dtype: torch.dtype, arch: str) -> PrefillKernel:
    dname = DTYPE_NAMES.get(dtype)
    interp = arch == triton_build.INTERPRETER_ARCH
    if dname is None or (dname == "fp32" and not interp):
        raise InputError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    config = triton_build.pick_config(dname, layer.head_dim, arch)
    name = kernel_name(layer, dname)
    key = cache.make_key(
        name,
        spec_json=layer.to_json(),
        template=template_bytes(triton_build.TEMPLATE),
        arch=arch,
        extra={"kind": "prefill", "dtype": dname, "config": config},
    )
    module_name = f"sparsegen_kernel_{key.digest[:24]}"

    def build():
        source = triton_build.render_source(layer, config)
        files = {triton_build.SOURCE_FILE: source.encode()}
        if not interp:
            files.update(triton_build.aot_compile(source, dname, arch, config, module_name))
        return files, {"kind": "prefill", "name": name, "arch": arch, "dtype": dname, "config": config}

    def load(files: dict[str, Path]):
        if interp:
            return triton_build.load_interpreted(files, module_name)
        if current_arch() != arch:
            return dict(files)  # compiled ahead of time for another arch: keep the files only
        return triton_build.load_compiled(files, dname)

    fn = triton_build.KERNEL_FN
    required = (
        (triton_build.SOURCE_FILE,) if interp else (triton_build.SOURCE_FILE, f"{fn}.cubin", f"{fn}.json")
    )
    found = cache.load_or_build(key, build, load, required=required, label=f"{name} for {arch}")
    status = "cached" if found.status == "memory" else found.status
    return PrefillKernel(
        layer, dtype, arch, config, name, key.key, found.path, status, found.seconds, found.value
    )


def forget() -> None:
    """Drop this process's kernels (memo and the cache's memory layer); the disk stays."""
    _MEMO.clear()
    _MEMO_BY_VALUE.clear()
    cache.forget_memory()


def get_prefill_kernel(layer: LayerSpec, *, dtype, arch: str | None = None) -> PrefillKernel:
    """The prefill kernel for `layer` (compiled on first use, then from the cache)."""
    memo_key = (id(layer), dtype, arch, _interpreting())
    hit = _MEMO.get(memo_key)
    if hit is not None and hit[0] is layer:
        hit[1].status = "cached"  # a repeat in this process
        return hit[1]
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
    resolved = arch
    if resolved is None and _interpreting():
        resolved = triton_build.INTERPRETER_ARCH
    elif resolved is None:
        resolved = current_arch()
        if resolved is None:
            raise ImplUnavailableError("no CUDA GPU here: pass arch= (e.g. 'sm_90') to compile ahead of time")
    else:
        env.parse_arch(resolved)
    value_key = (layer, dtype, resolved)
    kernel = _MEMO_BY_VALUE.get(value_key)
    if kernel is None:
        kernel = _lookup(layer, dtype, resolved)
        _MEMO_BY_VALUE[value_key] = kernel
    else:
        kernel.status = "cached"
    _MEMO[memo_key] = (layer, kernel)
    return kernel


def triton_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_k, layer: LayerSpec, scale=None, *, check: bool = True
) -> torch.Tensor:
    """`sparsegen.prefill(..., impl="triton")`: q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D]."""
    if not isinstance(q, torch.Tensor):
        raise InputError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dtype = q.dtype
    if dtype == torch.float32 and not _interpreting():
        raise InputError("q has dtype torch.float32; the compiled kernel supports float16 and bfloat16")
    kernel = get_prefill_kernel(layer, dtype=dtype)
    return kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, scale, check=check)


def _precompile_one(job: tuple[str, str, str]) -> str:
    spec_json, dtype_name, arch = job
    layer = LayerSpec.from_json(spec_json)
    return get_prefill_kernel(layer, dtype=getattr(torch, dtype_name), arch=arch).key


def precompile(layers, dtypes, *, arch: str, workers: int | None = None) -> list[str]:
    """Build many kernels into the disk cache in parallel processes (Triton compiles on one core)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    jobs = [
        (layer.to_json(), dtypes.resolve(dt).torch_name, arch)
        for layer in dict.fromkeys(layers)
        for dt in dtypes
    ]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=get_context("spawn")) as pool:
        return list(pool.map(_precompile_one, jobs))
