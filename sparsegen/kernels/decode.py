"""Paged decode on the GPU: render the CUDA template for a layer, compile it with NVRTC, launch it.

    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16)   # compiled + cached
    out = kernel(q, k_cache, v_cache, block_tables, seq_lens)              # [B, H, D]

Launch: grid (splits, head groups, batch) of 4 independent warps; a head group is up to 8 query
heads of one KV head. Scores and P.V run on tensor cores (mma.sync, fp32 accumulate). With more
than one split, each block writes an unnormalised partial (`part_o`, plus its running max and
sum in `part_ml`) and a second kernel merges the splits. The split count comes from the
shapes only (no host sync), and scratch comes from torch's allocator on the current stream, so a
decode step can be captured in a CUDA graph.

Out-of-range page ids: unchecked (the default), the kernel treats every token on such a page as
masked and never reads it, so the sequence gets a finite but meaningless output (zeros when no
token is left) and the process survives. `check=True` or SPARSEGEN_DEBUG=1 validates seq_lens
and every used page id on the host first (one device->host copy) and raises InputError.
"""

from __future__ import annotations

import math
import types

import numpy as np
import torch

from .. import codegen, dtypes, env
from ..errors import CompileError, ImplUnavailableError, InputError
from ..jit import cache
from ..jit import nvrtc_build as nb
from ..spec import MAX_SEQ_LEN, LayerSpec
from ..validate import check_decode_inputs, softmax_scale
from .decode_template import DEFAULT_KNOBS, TEMPLATE, TILE, heads_per_block, kernel_name, render_source

KERNEL = "sparsegen_paged_decode"
REDUCE = "sparsegen_paged_decode_reduce"
MAX_SPLITS = 256  # as in the template's reduce kernel
BLOCKS_PER_SM = 4  # resident blocks of the default build (128 registers x 4 warps)
MAX_CONTEXT = MAX_SEQ_LEN  # tokens per sequence (2^23): keeps the template's split arithmetic within 32 bits
PAGE_SIZES = range(8, 129)


def _dtype_name(dtype) -> str:
    return dtypes.resolve(dtype, kernel=True).name


def _check_page_size(page_size: object) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size not in PAGE_SIZES:
        raise InputError(f"page_size must be an int in 8..128, got {page_size!r}")
    return page_size


class DecodeKernel:
    """A compiled paged-decode kernel for one (layer, dtype, page size, arch); call it like
    `sparsegen.paged_decode`. Compiled ahead of time for another arch it can be stored and
    inspected (`source`, `path`) but not run."""

    def __init__(self, layer, dtype_name, page_size, arch, key, source, cubin) -> None:
        self.layer, self.dtype_name, self.page_size, self.arch = layer, dtype_name, page_size, arch
        self.key, self.name, self.source, self.cubin = key.key, key.name, source, cubin
        self.path, self.status, self.seconds = None, "compiled", 0.0
        self.heads_per_block = heads_per_block(layer)
        self._modules: dict[int, nb.CubinModule] = {}

    def __repr__(self) -> str:
        return f"DecodeKernel({self.key}, arch={self.arch}, status={self.status})"

    def _module(self, device: torch.device) -> nb.CubinModule:
        mod = self._modules.get(device.index)
        if mod is None:
            here = f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
            if here.rstrip("a") != self.arch.rstrip("a"):
                raise ImplUnavailableError(
                    f"kernel {self.key} was compiled for {self.arch}; this GPU is {here}"
                )
            with torch.cuda.device(device):
                mod = nb.CubinModule(self.cubin, (KERNEL, REDUCE))
            self._modules[device.index] = mod
        return mod

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, layer=None, scale=None, *, check=None):
        if layer is not None and layer != self.layer:
            raise InputError(f"kernel {self.name} was built for another layer spec")
        return cuda_paged_decode(
            q, k_cache, v_cache, block_tables, seq_lens, self.layer, scale, check=bool(check), kernel=self
        )

    def launch(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float, splits=None) -> torch.Tensor:
        """Launch on the current stream; inputs already validated. `splits` overrides the heuristic."""
        batch, num_heads, head_dim = q.shape  # q: [B, H, D]
        num_pages, page_size = k_cache.shape[:2]  # caches: [pages, page_size, Hkv, D]
        max_pages = block_tables.shape[1]  # block_tables: [B, max_pages]
        groups = num_heads // self.heads_per_block
        if splits is None:
            splits = num_splits(batch * groups, max_pages * page_size, _sm_count(q.device))
        splits = max(1, min(int(splits), MAX_SPLITS))
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [B, H, D]
        if splits > 1:
            part_o = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((batch, num_heads, splits, 2), dtype=torch.float32, device=q.device)
            po, pml = part_o.data_ptr(), part_ml.data_ptr()
        else:
            po = pml = 0
        mod = self._module(q.device)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        i64, i32 = np.int64, np.int32
        args = (
            np.uint64(q.data_ptr()), i64(q.stride(0)), i64(q.stride(1)),
            np.uint64(k_cache.data_ptr()), i64(k_cache.stride(0)), i64(k_cache.stride(1)), i64(k_cache.stride(2)),
            np.uint64(v_cache.data_ptr()), i64(v_cache.stride(0)), i64(v_cache.stride(1)), i64(v_cache.stride(2)),
            np.uint64(block_tables.data_ptr()), i64(block_tables.stride(0)), i32(max_pages), i32(num_pages),
            np.uint64(seq_lens.data_ptr()), np.float32(scale * math.log2(math.e)),
            np.uint64(out.data_ptr()), np.uint64(po), np.uint64(pml), i32(splits),
        )  # fmt: skip
        mod.launch(KERNEL, stream, (splits, groups, batch), 128, *args)
        if splits > 1:  # grid (rows, 32-dim slices), block (32 dims, up to 16 warps over the splits)
            mod.launch(REDUCE, stream, (batch * num_heads, head_dim // 32), (32, min(16, splits)),
                       np.uint64(po), np.uint64(pml), np.uint64(out.data_ptr()), i32(splits))  # fmt: skip
        return out


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def num_splits(rows: int, max_context: int, sm_count: int) -> int:
    """Split-KV count from shapes only (no host sync): about BLOCKS_PER_SM blocks per SM in all,
    i.e. one full resident wave, at least 4 CHUNKs (256 tokens) per split, at most MAX_SPLITS,
    rounded down to 2^k or 3 * 2^k.

    rows = batch x head groups. Tuned on an H200 (benchmarks/decode_notes.md): with cheap blocks
    the best split keeps every block resident at once (extra waves only add the partials and the
    merge). Since splits share weighted work (split_bound in the template), a full wave of 4
    blocks per SM beat 3; on 132 SMs this picks 1 split at 64 x 8K, 8 at 8 x 32K and 64 at 1 x 128K.
    """
    chunks = -(-max_context // TILE)
    want = min(max(1, BLOCKS_PER_SM * sm_count // max(rows, 1)), max(1, chunks // 4), MAX_SPLITS)
    p = 1 << (want.bit_length() - 1)
    return 3 * p // 2 if p >= 2 and want >= 3 * p // 2 else p


def compile_variant(layer: LayerSpec, *, dtype, page_size: int = 16, arch: str | None = None, **knobs: int):
    """A kernel built with non-default template knobs, uncached (for benchmarks and tests)."""
    dtype_name = _dtype_name(dtype)
    page_size = _check_page_size(page_size)
    arch = env.resolve_arch(arch)
    name = kernel_name(layer, dtype_name, page_size) + "".join(f"_{k}{v}" for k, v in sorted(knobs.items()))
    source = render_source(layer, dtype_name, page_size, **knobs)
    cubin, _ = nb.compile_cubin(source, arch, name=f"{name}.cu")
    key = types.SimpleNamespace(key=f"{name}-uncached", name=name)
    return DecodeKernel(layer, dtype_name, page_size, arch, key, source, cubin)


# Per-process memo: (id(layer), dtype, arch, page_size) -> (layer, kernel). A repeated get is a
# dict lookup; the id is confirmed with `is`, and equal-but-distinct specs fall back to `_BY_SPEC`.
_BY_ID: dict[tuple, tuple[LayerSpec, DecodeKernel]] = {}
_BY_SPEC: dict[tuple, DecodeKernel] = {}


def forget() -> None:
    """Drop this process's decode kernels (memos and the cache's memory layer); the disk stays."""
    _BY_ID.clear()
    _BY_SPEC.clear()
    cache.forget_memory()


def get_decode_kernel(
    layer: LayerSpec, *, dtype, arch: str | None = None, page_size: int = 16
) -> DecodeKernel:
    """The compiled kernel for this layer, dtype, page size and arch (default: this GPU's)."""
    fast = (id(layer), dtype, arch, page_size)
    hit = _BY_ID.get(fast)
    if hit is not None and hit[0] is layer:
        hit[1].status = "cached"  # a repeat in this process
        return hit[1]
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
    dtype_name = _dtype_name(dtype)
    page_size = _check_page_size(page_size)
    arch = env.resolve_arch(arch)
    spec_key = (layer, dtype_name, arch, page_size)
    kernel = _BY_SPEC.get(spec_key)
    if kernel is None:
        kernel = _build_or_load(layer, dtype_name, arch, page_size)
        _BY_SPEC[spec_key] = kernel
    else:
        kernel.status = "cached"
    _BY_ID[fast] = (layer, kernel)
    return kernel


def _build_or_load(layer: LayerSpec, dtype_name: str, arch: str, page_size: int) -> DecodeKernel:
    name = kernel_name(layer, dtype_name, page_size)
    key = cache.make_key(
        name,
        spec_json=layer.to_json(),
        template=codegen.template_bytes(TEMPLATE),
        arch=arch,
        extra={"kind": "decode", "dtype": dtype_name, "page_size": page_size, "knobs": DEFAULT_KNOBS},
    )

    def build():
        source = render_source(layer, dtype_name, page_size)
        cubin, log = nb.compile_cubin(source, arch, name=f"{name}.cu")
        meta = {"kind": "decode", "name": name, "arch": arch, "dtype": dtype_name, "page_size": page_size}
        if log.strip():
            meta["nvrtc_log"] = log[-2000:]
        return {"kernel.cu": source.encode(), "kernel.cubin": cubin}, meta

    def load(files):
        try:
            source = files["kernel.cu"].read_text()
            cubin = files["kernel.cubin"].read_bytes()
        except (KeyError, OSError) as exc:
            raise CompileError(f"cache entry {name} is missing a file: {exc}") from None
        return DecodeKernel(layer, dtype_name, page_size, arch, key, source, cubin)

    found = cache.load_or_build(
        key, build, load, required=("kernel.cu", "kernel.cubin"), label=f"{name} ({arch})"
    )
    kernel = found.value
    kernel.path = str(found.path)
    kernel.status = "compiled" if found.status == "compiled" else "cached"
    kernel.seconds = found.seconds
    return kernel


def check_kernel_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    """What the kernel needs beyond validate.check_decode_inputs: page size, strides, alignment."""
    _check_page_size(k_cache.shape[1])
    if k_cache.shape[0] >= 2**31:
        raise InputError(f"k_cache has {k_cache.shape[0]} pages; page ids must fit in 32 bits")
    span = block_tables.shape[1] * k_cache.shape[1]
    if span > MAX_CONTEXT:
        raise InputError(
            f"block_tables has {block_tables.shape[1]} columns of {k_cache.shape[1]}-token pages "
            f"({span} tokens); the decode kernel handles at most {MAX_CONTEXT} tokens per sequence"
        )
    if not q.is_cuda:
        raise ImplUnavailableError(f"the CUDA decode kernel needs tensors on a GPU, q is on {q.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise InputError(
                f"{name} must be contiguous in its last (head_dim) dim, got strides {t.stride()}"
            )
        if any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise InputError(
                f"{name} must be 16-byte aligned with strides that are multiples of 8 elements, "
                f"got strides {t.stride()} and address {t.data_ptr():#x}"
            )
    if block_tables.stride(1) != 1:
        raise InputError(
            f"block_tables must be contiguous in its last dim, got strides {block_tables.stride()}"
        )
    if seq_lens.stride(0) != 1:
        raise InputError(f"seq_lens must be contiguous, got stride {seq_lens.stride()}")


def cuda_paged_decode(
    q, k_cache, v_cache, block_tables, seq_lens, layer, scale=None, *, check: bool = False, kernel=None
) -> torch.Tensor:
    """Validate, fetch the compiled kernel, launch on the current stream. Returns [B, H, D]."""
    check_decode_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, layer, allow_cpu=False, check_pages=check
    )
    check_kernel_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if kernel is None:
        kernel = get_decode_kernel(layer, dtype=q.dtype, page_size=k_cache.shape[1])
    elif dtypes.name(q.dtype) != kernel.dtype_name or k_cache.shape[1] != kernel.page_size:
        raise InputError(
            f"kernel {kernel.name} is for {kernel.dtype_name} with page_size {kernel.page_size}; "
            f"got {q.dtype} with page_size {k_cache.shape[1]}"
        )
    scale = softmax_scale(scale, layer.head_dim)
    return kernel.launch(q, k_cache, v_cache, block_tables, seq_lens, scale)
