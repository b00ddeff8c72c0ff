"""Decode-step linear layers at batch 2..32 as CUDA kernels: `x @ W.T + b` for up to 32 rows.

At 32 rows a 7b decode step's linear layers still only read their weights once (15.6 GB), but
cuBLAS's kernels for these shapes lose 3-6 us each to their start and end (measured on the H200:
qkv 18 us against an 11.8 us copy-rate floor, O 12.2 against 7.9). These kernels (templates
gemm_rows.cu.jinja and gemm_rows_resident.cu.jinja, helpers in gemm_rows_common.cuh.jinja) split
K over the blocks of a thread-block cluster so that about one block per SM streams its slab of
W through a cp.async ring, sum the cluster's float32 partials through distributed shared memory
in a fixed order, and request their first W tiles before they wait for the kernel before them
(programmatic dependent launch). Epilogues: the bias; GeGeLU over up_proj's output pairs; a
decode step's rotary and K/V cache write for QKV (`RopeWrite`).

    y = gemm_rows(x, weight, bias)                   # x: [M <= 32, K], weight: [N, K] -> [M, N]
    act = gemm_rows(x, w_up, b_up, gegelu_limit=20)  # -> [M, N / 2]
    q = gemm_rows(x, w_qkv, b_qkv, rope=RopeWrite(cos, sin, group, k_cache, v_cache, slots))

One kernel per `Build` (shape, dtype, tile, epilogue): a request of the lifecycle (`kernels.base`,
family "gemm_rows" in `kernels.families.gemm_rows`), rendered, compiled with NVRTC for sm_90 (0.2-0.9 s each on a CPU), cached
on disk and loaded once per device; `lookup(build)` builds one ahead of time. sm_90 only:
clusters and the PDL instructions need Hopper. Which of the model's linears use it is the
model's policy (`models.layers.ROWS_LAYERS`).
"""

from __future__ import annotations

import numpy as np
import torch

from ... import dtypes, env
from ...env import parse_arch
from ...errors import InputError
from ...jit import nvrtc_build as nb
from .. import base
from ..base import KernelRequest
from ..families.gemm_rows import ARCH, KERNEL, Build
from .gemm_rows_tiles import MAX_ROWS, TUNED_ROPE_TILES, Tile, tile_for
from .rope_write import RopeWrite


def lookup(build: Build, arch: str = ARCH) -> base.Lookup:
    """The kernel of `build` through the lifecycle (memo, disk cache, NVRTC; no GPU needed)."""
    return base.lookup(KernelRequest.of("gemm_rows", build, dtype=build.dtype, arch=arch))


_MODULES: dict[tuple, nb.CubinModule] = {}  # (Build, device index) -> loaded module: the launch's memo
base.on_forget(_MODULES.clear)


def _module(build: Build, device: torch.device) -> nb.CubinModule:
    mod = _MODULES.get((build, device.index))
    if mod is None:  # InputError for a bad tile or epilogue (the request's check), before any build
        mod = _MODULES[(build, device.index)] = lookup(build).kernel.module(device)
    return mod


def build_for(n: int, k: int, dtype: str, has_bias: bool = True, gegelu: bool = False, rope=None, tile=None,
              skip_mma: bool = False) -> Build:  # fmt: skip
    """The Build a launch of an [n, k] weight makes: `tile`, else TUNED_ROPE_TILES or tile_for
    (whole heads per tile with the rotary epilogue, `rope` = (head_dim, group))."""
    if tile is None:
        tile = TUNED_ROPE_TILES.get((n, k)) or tile_for(n, k, rope[0]) if rope else tile_for(n, k)
    return Build(n, k, dtype, tile, has_bias, gegelu, rope, bool(skip_mma))


def supported(device: torch.device) -> bool:
    """Whether this kernel runs on `device`: a CUDA device of compute capability 9.x."""
    arch = env.current_arch(device)  # cached per device
    return arch is not None and parse_arch(arch) // 10 == 9


def operand_ok(t: torch.Tensor) -> bool:
    """Whether the kernel can read `t` as x or W: 2-D, unit column stride, a row stride that is a
    multiple of 8 elements and a 16-byte aligned start (its cp.async copies 16 bytes)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _check_operand(t: torch.Tensor, name: str) -> None:
    if not operand_ok(t):
        raise InputError(
            f"gemm_rows: {name} must be 2-D with unit column stride, a row stride that is a multiple "
            f"of 8 and a 16-byte aligned start; got shape {tuple(t.shape)}, strides {t.stride()}"
        )


# A build without the rotary epilogue still takes its arguments: null pointers and zeros.
_NO_ROPE = (np.uint64(0), np.uint64(0), np.int64(0), np.uint64(0), np.uint64(0), np.uint64(0),
            np.int64(1), np.int64(0), np.int64(0), np.int64(0))  # fmt: skip


def _rope_args(rope: RopeWrite, n: int, x: torch.Tensor) -> tuple:
    """The checked rotary tables, caches and slots of a RopeWrite for x's M tokens: ((head_dim,
    group), the kernel arguments after the common ones, the float32 tables to keep alive until
    the launch is queued)."""
    cos, sin = rope.checked(n, x.shape[0], x, "gemm_rows rope")  # [M, D] each
    kc, vc, slots = rope.k_cache, rope.v_cache, rope.slot
    d = kc.shape[3]
    i64, ptr = np.int64, np.uint64
    return (
        (d, rope.group),
        (ptr(cos.data_ptr()), ptr(sin.data_ptr()), i64(d), ptr(kc.data_ptr()), ptr(vc.data_ptr()),
         ptr(slots.data_ptr()), i64(kc.shape[1]), i64(kc.stride(0)), i64(kc.stride(1)), i64(kc.stride(2))),
        (cos, sin),
    )  # fmt: skip


def gemm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tile: Tile | None = None,
    pdl: bool | None = None,
    out: torch.Tensor | None = None,
    gegelu_limit: float | None = None,
    rope: RopeWrite | None = None,
    skip_mma: bool = False,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for x: [M, K] with 1 <= M <= 32, weight: [N, K] (rows contiguous),
    bias: [N]; returns [M, N] in x's dtype (into `out`, a contiguous [M, N] tensor, if given).
    float32 sums, the bias added before the one rounding. `tile` overrides tile_for; `pdl`
    (default: where `env.supports_pdl`) launches with programmatic dependent launch. Epilogues:
    - `gegelu_limit`: up_proj's GeGeLU over the interleaved (gate, linear) output pairs:
      [M, N / 2], rounded as `models.layers.gegelu(F.linear(...))` rounds;
    - `rope` (a decode step's QKV, N = Hkv x (G + 2) x D): returns the rotated q [M, Hkv G D]
      and writes the rotated k and v into the caches at each token's slot, rounded as
      `fused.rotary.rotary_qkv(F.linear(...))` rounds.
    `skip_mma`: see Build (benchmarks only)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise InputError("gemm_rows: x and weight must be tensors")
    if not x.is_cuda or not supported(x.device):
        raise InputError(f"gemm_rows runs on sm_90 GPUs only, got a tensor on {x.device}")
    if weight.device != x.device or weight.dtype != x.dtype:
        raise InputError(
            f"gemm_rows: weight ({weight.dtype}, {weight.device}) must match x ({x.dtype}, {x.device})"
        )
    row = dtypes.resolve(x.dtype, kernel=True, what="gemm_rows dtype")
    _check_operand(x, "x")
    _check_operand(weight, "weight")
    m, k = x.shape  # x: [M, K]
    n = weight.shape[0]  # weight: [N, K]
    if weight.shape[1] != k:
        raise InputError(f"gemm_rows: weight is {tuple(weight.shape)} but x has {k} columns")
    if not 1 <= m <= MAX_ROWS:
        raise InputError(f"gemm_rows takes 1..{MAX_ROWS} rows, got {m}")
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device or bias.stride(0) != 1:
            raise InputError(f"gemm_rows: bias must be a contiguous [{n}] {x.dtype} tensor on {x.device}")
    gegelu = gegelu_limit is not None
    if gegelu and (
        isinstance(gegelu_limit, bool) or not isinstance(gegelu_limit, (int, float)) or gegelu_limit <= 0
    ):
        raise InputError(f"gemm_rows: gegelu_limit must be a positive number, got {gegelu_limit!r}")
    if rope is not None and not isinstance(rope, RopeWrite):
        raise InputError(f"gemm_rows: rope must be a RopeWrite, got {type(rope).__name__}")
    rope_spec, rope_args, _keep = _rope_args(rope, n, x) if rope is not None else (None, _NO_ROPE, ())
    build = build_for(n, k, row.name, bias is not None, gegelu, rope_spec, tile, skip_mma)
    tile = build.tile  # the tile the build chose when the caller named none
    mod = _module(build, x.device)  # InputError for a bad tile or epilogue before anything is allocated
    n_out = n // 2 if gegelu else n // (rope_spec[1] + 2) * rope_spec[1] if rope_spec else n
    if out is None:
        y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)  # y: [M, N], [M, N / 2] or q [M, Hkv G D]
    elif out.shape != (m, n_out) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise InputError(f"gemm_rows: out must be a contiguous [{m}, {n_out}] {x.dtype} tensor on {x.device}")
    else:
        y = out
    stream = torch.cuda.current_stream(x.device).cuda_stream
    pdl = env.supports_pdl(x.device) if pdl is None else bool(pdl)
    i64 = np.int64
    args = (
        np.uint64(x.data_ptr()), i64(x.stride(0)), np.uint64(weight.data_ptr()), i64(weight.stride(0)),
        np.uint64(0 if bias is None else bias.data_ptr()), np.uint64(y.data_ptr()), i64(y.stride(0)), np.int32(m),
        np.float32(gegelu_limit if gegelu else 0.0), *rope_args,
    )  # fmt: skip
    mod.launch(KERNEL, stream, (n // tile.block_n,), tile.threads(), *args, pdl=pdl,
               cluster=(tile.split,) if tile.split > 1 else None, shmem=tile.smem_bytes(k))  # fmt: skip
    return y


def occupancy(n: int, k: int, tile: Tile, device: torch.device) -> dict:
    """What the driver says of one bf16 build on `device`: blocks per SM, and for a cluster
    launch how many clusters can run at once (benchmarks: every block fits in one wave when
    max_active_clusters >= clusters = N / block_n)."""
    mod = _module(Build(n, k, "bf16", tile), device)
    kern = mod.kernels[KERNEL]
    out = {
        "blocks_per_sm": kern.occupancy.max_active_blocks_per_multiprocessor(
            tile.threads(), tile.smem_bytes(k)
        )
    }
    config = nb._core().LaunchConfig(
        grid=(n // tile.block_n,), cluster=(tile.split,) if tile.split > 1 else None, block=tile.threads(),
        shmem_size=tile.smem_bytes(k),
    )  # fmt: skip
    stream = mod.stream(torch.cuda.current_stream(device).cuda_stream)
    out["max_active_clusters"] = kern.occupancy.max_active_clusters(config, stream=stream)
    out["clusters"] = n // tile.block_n
    return out
