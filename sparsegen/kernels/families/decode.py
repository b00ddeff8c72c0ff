"""Paged decode on the GPU, the "decode" family: render the CUDA template for a layer, compile it
with NVRTC, launch it.

    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16)   # kernels.decode: cached
    out = kernel(q, k_cache, v_cache, block_tables, seq_lens)              # [B, H, D]

Launch: grid (splits, head groups, batch) of 4 independent warps; a head group is up to 8 query
heads of one KV head. Scores and P.V run on tensor cores (mma.sync, fp32 accumulate). With more
than one split, each block writes an unnormalised partial (`part_o`, plus its running max and
sum in `part_ml`), and either the last block of each head group to finish merges the splits in
the same launch or a second kernel does (decode_merge.use_fused picks; bitwise the same result).
The split count comes from the shapes only (no host sync), scratch comes from torch's allocator
on the current stream and the fused merge's counters from a per-stream cache that the kernel
leaves at zero, so a decode step can be captured in a CUDA graph.

fp8 caches (a request with kv_dtype "fp8e4m3" / "fp8e5m2", sm_89+): the kernel reads the fp8
bytes and dequantises in registers; `k_scale` / `v_scale` (float32 [Hkv] or []) are pointers it
reads on the device, so a captured graph replays with whatever values they hold then.

Out-of-range page ids: unchecked (the default), the kernel treats every token on such a page as
masked and never reads it, so the sequence gets a finite but meaningless output (zeros when no
token is left) and the process survives. `check=True` or SPARSEGEN_DEBUG=1 validates seq_lens
and every used page id on the host first (one device->host copy) and raises InputError.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ... import dtypes, env
from ...errors import CompileError, ImplUnavailableError, InputError
from ...jit import nvrtc_build as nb
from ...spec import MAX_SEQ_LEN
from ...validate import check_bool, check_decode_inputs, check_features, layer_scale
from ..decode_merge import COUNTERS, use_fused
from ..decode_template import (
    DEFAULT_KNOBS,
    FEATURES,
    FP8_MIN_ARCH,
    HEAD_DIMS,
    KERNEL,
    KV_FP8,
    MAX_SPLITS,
    PAGE_SIZES,
    REDUCE,
    REDUCE_WARPS,
    SOURCE_FILE,
    TILE,
    heads_per_block,
    kernel_name,
    render_source,
    template_constants,
)
from ..family import Family, Kernel, Request, register

BLOCKS_PER_SM = 4  # resident blocks of the default build (128 registers x 4 warps)
MIN_SPLIT_TOKENS = 160  # fewest tokens per split (2.5 CHUNKs of TILE): see num_splits
MAX_CONTEXT = MAX_SEQ_LEN  # tokens per sequence (2^23): keeps the template's split arithmetic within 32 bits


class DecodeKernel(Kernel):
    """A compiled paged-decode kernel for one request; call it like `sparsegen.paged_decode`.
    Compiled ahead of time for another arch it can be stored and inspected (`source`, `path`)
    but not run."""

    def __init__(
        self,
        request: Request,
        key: str,
        name: str,
        path,
        source: str,
        cubin: bytes,
        *,
        fused_merge=True,
    ) -> None:
        super().__init__(request, key, name, path, source)
        self.cubin = cubin
        self.page_size = request.page_size
        self.heads_per_block = heads_per_block(request.layer)
        self.fused_merge = bool(fused_merge)  # built with the in-kernel split merge (template knob)
        self.kv_dtype = request.kv_dtype  # '' (K/V of q's dtype) or "fp8e4m3" / "fp8e5m2"
        self._modules: dict[int, nb.CubinModule] = {}

    def _module(self, device: torch.device) -> nb.CubinModule:
        mod = self._modules.get(device.index)
        if mod is None:
            here = env.current_arch(device)
            if here != self.arch.rstrip("a"):
                raise ImplUnavailableError(
                    f"kernel {self.key} was compiled for {self.arch}; this GPU is {here}"
                )
            with torch.cuda.device(device):
                mod = nb.CubinModule(self.cubin, (KERNEL, REDUCE))
            self._modules[device.index] = mod
        return mod

    def __call__(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        layer=None,
        scale=None,
        *,
        check=None,
        pdl=False,
        sinks=None,
        k_scale=None,
        v_scale=None,
    ):
        """Validate (`check`: seq_lens and page ids too, on the host), launch on the current
        stream: `sparsegen.paged_decode` with this kernel. Returns [B, H, D]."""
        if layer is not None and layer != self.layer:
            raise InputError(f"kernel {self.name} was built for another layer spec")
        pdl = check_bool("pdl", pdl)
        check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, self.layer, allow_cpu=False,
                            check_pages=bool(check), kernel=True, sinks=sinks, k_scale=k_scale,
                            v_scale=v_scale)  # fmt: skip
        check_kernel_inputs(q, k_cache, v_cache, block_tables, seq_lens)
        scale = layer_scale(scale, self.layer)
        return launch_matching(self, q, k_cache, v_cache, block_tables, seq_lens, scale, pdl=pdl, sinks=sinks,
                               k_scale=k_scale, v_scale=v_scale)  # fmt: skip

    def launch(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale: float,
        splits=None,
        merge=None,
        pdl=False,
        sinks=None,
        k_scale=None,
        v_scale=None,
    ) -> torch.Tensor:
        """Launch on the current stream; inputs already validated. `splits` overrides the heuristic
        (clamped to 1..MAX_SPLITS); `merge` ("fused" / "separate") overrides decode_merge's rule.
        `pdl` (sm_90+; ignored before): programmatic dependent launch, see `sparsegen.paged_decode`.
        `sinks` ([H] float32): exactly when the layer has learned sinks (the last kernel argument).
        `k_scale` / `v_scale` (float32 [Hkv] or [], on q's device): exactly for an fp8 kernel;
        their presence, dtype, shape and device are checked here too (their values are not)."""
        if (sinks is None) == self.layer.learned_sinks:
            raise InputError(
                f"kernel {self.name}: sinks= is required exactly when the layer has learned_sinks"
            )
        scale_args = fp8_scale_args(self, q, k_cache, k_scale, v_scale, sinks)
        batch, num_heads, head_dim = q.shape  # q: [B, H, D]
        num_pages, page_size = k_cache.shape[:2]  # caches: [pages, page_size, Hkv, D]
        max_pages = block_tables.shape[1]  # block_tables: [B, max_pages]
        groups = num_heads // self.heads_per_block
        if splits is None:
            splits = num_splits(batch * groups, max_pages * page_size, _sm_count(q.device))
        splits = max(1, min(int(splits), MAX_SPLITS))
        fused = use_fused(splits, self.heads_per_block, head_dim, merge)
        if fused and not self.fused_merge:
            if merge == "fused":
                raise InputError(f"kernel {self.name} was built without the fused merge (fused_merge=0)")
            fused = False
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [B, H, D]
        if splits > 1:
            part_o = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((batch, num_heads, splits, 2), dtype=torch.float32, device=q.device)
            po, pml = part_o.data_ptr(), part_ml.data_ptr()
        else:
            po = pml = 0
        mod = self._module(q.device)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        # the fused merge's counters: [>= B * groups] int32, zero
        counters = COUNTERS.get(q.device, stream, batch * groups).data_ptr() if fused else 0
        i64, i32 = np.int64, np.int32
        args = (
            np.uint64(q.data_ptr()), i64(q.stride(0)), i64(q.stride(1)),
            np.uint64(k_cache.data_ptr()), i64(k_cache.stride(0)), i64(k_cache.stride(1)), i64(k_cache.stride(2)),
            np.uint64(v_cache.data_ptr()), i64(v_cache.stride(0)), i64(v_cache.stride(1)), i64(v_cache.stride(2)),
            np.uint64(block_tables.data_ptr()), i64(block_tables.stride(0)), i32(max_pages), i32(num_pages),
            np.uint64(seq_lens.data_ptr()), np.float32(scale * math.log2(math.e)),
            np.uint64(out.data_ptr()), np.uint64(po), np.uint64(pml), i32(splits), np.uint64(counters),
        )  # fmt: skip
        args += scale_args
        sink_args = (np.uint64(sinks.data_ptr()),) if sinks is not None else ()  # sinks: [H] float32
        args += sink_args
        pdl = bool(pdl) and env.supports_pdl(q.device)
        mod.launch(KERNEL, stream, (splits, groups, batch), 128, *args, pdl=pdl)
        if splits > 1 and not fused:  # grid (rows, 32-dim slices), block (32 dims, warps over the splits)
            mod.launch(REDUCE, stream, (batch * num_heads, -(-head_dim // 32)), (32, min(REDUCE_WARPS, splits)),
                       np.uint64(po), np.uint64(pml), np.uint64(out.data_ptr()), i32(splits), *sink_args,
                       pdl=pdl)  # fmt: skip
        return out


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def num_splits(rows: int, max_context: int, sm_count: int) -> int:
    """Split-KV count from shapes only (no host sync): about BLOCKS_PER_SM blocks per SM in all,
    i.e. one full resident wave, at least MIN_SPLIT_TOKENS (2.5 CHUNKs) per split, at most
    MAX_SPLITS, rounded down to 2^k or 3 * 2^k.

    rows = batch x head groups. Tuned on an H200 (benchmarks/decode/NOTES.md): with cheap blocks
    the best split keeps every block resident at once (extra waves only add the partials and the
    merge). Since splits share weighted work (split_bound in the template), a full wave of 4
    blocks per SM beat 3; on 132 SMs this picks 1 split at 64 x 8K, 8 at 8 x 32K and 64 at 1 x 128K.

    The floor of tokens per split decides only short contexts at batch 1-2. At 4 chunks (256
    tokens) it allowed only 32 splits at 1 x 8K (8 rows, a table of 512 pages): half a wave,
    which cost 29 % in the same shape at 8 x 32K (4 splits 194.8 us vs 8 splits 151.1 us,
    tune_decode_h200_s2_balanced.json). At 2 chunks (128 tokens) 1 x 8K took 64 splits, one
    wave, but 2-chunk splits are too short for their fixed cost (q load, warp merge, partial
    store): an engine sweep on the H200 at 1 x 8K (us per layer, CUDA-graph replays, with the
    separate reduce) gave, for the sparse layer, 32 splits 13.6, 48 -> 13.4, 64 -> 15.2, and for
    the dense layer 32 -> 13.7, 48 -> 13.2, 64 -> 13.3. A floor of 160 tokens picks 48 there (a
    table of 512-520 pages) and 24 at 1 x 4K; from 1 x 10.5K (2 x 5.3K) up the wave decides as
    before. (A graph bucket of 1024 pages, i.e. 8K+ contexts, still gets 64: the kernel divides
    the actual length, the count comes from the table width.)
    """
    chunks = -(-max_context // TILE)
    floor_cap = chunks * TILE // MIN_SPLIT_TOKENS
    want = min(max(1, BLOCKS_PER_SM * sm_count // max(rows, 1)), max(1, floor_cap), MAX_SPLITS)
    p = 1 << (want.bit_length() - 1)
    return 3 * p // 2 if p >= 2 and want >= 3 * p // 2 else p


class CudaDecode(Family):
    kind = "decode"
    variant = "cuda"
    source_file = SOURCE_FILE
    features = FEATURES
    head_dims = HEAD_DIMS
    kv_dtypes = frozenset(KV_FP8)

    def check(self, request: Request) -> None:
        if request.kv_dtype and env.parse_arch(request.arch) < FP8_MIN_ARCH:
            raise ImplUnavailableError(
                f"the fp8 decode kernels need sm_{FP8_MIN_ARCH} or newer (fp8 -> fp16 conversion), "
                f"not {request.arch}; impl='reference' computes it"
            )
        ps = request.page_size
        if isinstance(ps, bool) or not isinstance(ps, int) or ps not in PAGE_SIZES:
            raise InputError(
                f"page_size must be an int in {PAGE_SIZES.start}..{PAGE_SIZES.stop - 1}, got {ps!r}"
            )
        if request.params.knobs:  # unknown or bad template knobs: InputError now, before any build
            template_constants(request.layer, request.dtype, ps, kv_dtype=request.kv_dtype, **request.knobs)

    def name(self, request: Request) -> str:
        """kernel_name, with each template knob of the request spelled after it (`_fused_merge0`)."""
        knobs = "".join(f"_{k}{int(v)}" for k, v in request.params.knobs)
        return kernel_name(request.layer, request.dtype, request.page_size, request.kv_dtype) + knobs

    def render(self, request: Request) -> str:
        return render_source(request.layer, request.dtype, request.page_size, kv_dtype=request.kv_dtype,
                             **request.knobs)  # fmt: skip

    def build(self, request: Request, source: str, module_name: str) -> dict[str, bytes]:
        cubin, _log = nb.compile_cubin(source, request.arch, name=f"{self.name(request)}.cu")
        return {"kernel.cubin": cubin}

    def required(self, request: Request) -> tuple[str, ...]:
        return (SOURCE_FILE, "kernel.cubin")

    def load(self, request, files, key: str, path, module_name: str) -> DecodeKernel:
        try:
            source = files[SOURCE_FILE].read_text()
            cubin = files["kernel.cubin"].read_bytes()
        except (KeyError, OSError) as exc:
            raise CompileError(f"cache entry {key} is missing a file: {exc}") from None
        fused_merge = request.knobs.get("fused_merge", DEFAULT_KNOBS["fused_merge"])
        return DecodeKernel(request, key, self.name(request), path, source, cubin, fused_merge=fused_merge)


register(CudaDecode())


def check_kernel_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    """What this kernel needs beyond validate.check_decode_inputs: page size, id and span limits."""
    ps = k_cache.shape[1]
    if ps not in PAGE_SIZES:
        raise InputError(
            f"page_size must be in {PAGE_SIZES.start}..{PAGE_SIZES.stop - 1}, got k_cache pages of {ps}"
        )
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


def launch_matching(kernel: DecodeKernel, q, k_cache, v_cache, block_tables, seq_lens, scale: float, *,
                    pdl=False, sinks=None, k_scale=None, v_scale=None) -> torch.Tensor:  # fmt: skip
    """Launch `kernel` on the current stream once q's dtype, the caches' dtype and page size are
    the ones it was built for (inputs already checked: validate.check_decode_inputs, then
    check_kernel_inputs). Returns [B, H, D]."""
    if dtypes.name(q.dtype) != kernel.dtype_name or k_cache.shape[1] != kernel.page_size:
        raise InputError(
            f"kernel {kernel.name} is for {kernel.dtype_name} with page_size {kernel.page_size}; "
            f"got {q.dtype} with page_size {k_cache.shape[1]}"
        )
    return kernel.launch(q, k_cache, v_cache, block_tables, seq_lens, scale, pdl=pdl, sinks=sinks,
                         k_scale=k_scale, v_scale=v_scale)  # fmt: skip


def cache_kv_dtype(k_cache: torch.Tensor) -> str:
    """The decode request's kv_dtype for a cache tensor: '' unless it holds fp8."""
    return dtypes.FP8_NAMES.get(k_cache.dtype, "")


def fp8_scale_args(kernel: DecodeKernel, q, k_cache, k_scale, v_scale, sinks=None) -> tuple:
    """The fp8 kernel's scale arguments, (pointer, stride) for k_scale then v_scale, or () for a
    kernel over K/V of q's dtype. A launch checks them (and `sinks`) by the one rule of the
    public entry points, validate.check_features (without reading values: no device sync), so
    a kernel launched directly gets the same errors; and the cache's dtype must be the kernel's."""
    want, have = kernel.kv_dtype, cache_kv_dtype(k_cache)
    if have != want:
        raise InputError(
            f"kernel {kernel.name} reads {want or kernel.dtype_name} K/V, the cache holds {k_cache.dtype}"
        )
    check_features(
        kernel.layer, q, k_cache.dtype, sinks=sinks, k_scale=k_scale, v_scale=v_scale, values=False
    )
    if not want:
        return ()
    # a [] scale has stride 0: one scale for every KV head
    return (np.uint64(k_scale.data_ptr()), np.int32(1 if k_scale.dim() else 0),
            np.uint64(v_scale.data_ptr()), np.int32(1 if v_scale.dim() else 0))  # fmt: skip
