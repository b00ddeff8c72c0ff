"""Decode-step linear layers at batch 2..32 as CUDA kernels: `x @ W.T + b` for up to 32 rows.

At 32 rows a 7b decode step's linear layers still only read their weights once (15.6 GB), but
cuBLAS's kernels for these shapes lose 3-6 us each to their start and end (H200, session 10:
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

One build per `Build` (shape, dtype, tile, epilogue), rendered and compiled with NVRTC on first
use (0.2-0.9 s each on the CPU machine) and kept for the process. sm_90 only: clusters and the
PDL instructions need Hopper. Which of the model's linears use it: ROWS_LAYERS (`layers.rows_gemm`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .. import dtypes, env
from ..env import parse_arch
from ..errors import InputError
from ..jit import nvrtc_build as nb
from ..jit.render import render
from .rope import RopeWrite

KERNEL = "sparsegen_gemm_rows"
MAX_ROWS = 32  # rows of x one launch takes (the tile's MMA N side)
ARCH = "sm_90"


@dataclass(frozen=True)
class Tile:
    """block_n: W rows per block; block_k: K per ring stage; split: blocks per cluster, each
    taking K / split; stages: ring depth. Two kernels:
    - x_resident=False (templates/gemm_rows.cu.jinja): stages of [block_n, block_k] W + [32,
      block_k] x, one warp per 32 W rows;
    - x_resident=True (gemm_rows_resident.cu.jinja): x's [32, K / split] slice stays in shared
      memory and stages are [32, block_k] of W, 64 columns per warp, 32 W rows at a time."""

    block_n: int
    block_k: int
    split: int
    stages: int
    x_resident: bool = False
    rows_per_warp: int = 32  # ring kernel only: 32 (two m16 tiles per warp) or 16 (one; twice the warps)

    @property
    def template(self) -> str:
        return "gemm_rows_resident.cu.jinja" if self.x_resident else "gemm_rows.cu.jinja"

    def threads(self) -> int:
        return 32 * (self.block_k // 64) if self.x_resident else 32 * self.block_n // self.rows_per_warp

    def smem_bytes(self, k: int, elem_bytes: int = 2) -> int:
        b, bk = self.block_n, self.block_k
        if not self.x_resident:  # the partials reuse the ring (checked below)
            return self.stages * (b + MAX_ROWS) * bk * elem_bytes
        x_slice = MAX_ROWS * (k // self.split) * elem_bytes
        warp_sums = (bk // 64) * 32 * 33 * 4
        part = MAX_ROWS * (b + (36 - b % 32) % 32) * 4  # the partials, [32][block_n + pad] float32
        return x_slice + self.stages * 32 * bk * elem_bytes + warp_sums + part

    def check(self, n: int, k: int) -> None:
        """InputError unless this tile divides an [n, k] weight and fits one SM."""
        b, bk, s, st = self.block_n, self.block_k, self.split, self.stages
        for name, value in (("block_n", b), ("block_k", bk), ("split", s), ("stages", st)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"tile {name} must be a positive int, got {value!r}")
        if self.rows_per_warp not in (16, 32) or (self.x_resident and self.rows_per_warp != 32):
            raise InputError(f"tile {self}: rows_per_warp must be 32, or 16 in the ring kernel")
        if self.threads() > 1024:
            raise InputError(f"tile {self} needs {self.threads()} threads per block (> 1024)")
        if b % 32 or b > 1024 or bk % 64 or bk > 1024 or s not in (1, 2, 4, 8) or st < 2:
            raise InputError(f"tile {self} needs block_n % 32 == 0 (<= 1024), block_k % 64 == 0 (<= 1024), "
                             "split in (1, 2, 4, 8), stages >= 2")  # fmt: skip
        if n % b or k % (s * bk) or b % s:
            raise InputError(f"tile {self} does not divide a [{n}, {k}] weight")
        part = MAX_ROWS * (b + (36 - b % 32) % 32) * 4
        if not self.x_resident and part > self.smem_bytes(k):
            raise InputError(f"tile {self}: the [32, {b}] float32 partials do not fit in its ring")
        if self.smem_bytes(k) > SMEM_LIMIT:
            raise InputError(f"tile {self} needs {self.smem_bytes(k)} B of shared memory (> {SMEM_LIMIT})")


SMEM_LIMIT = 227 * 1024  # an sm_90 block's dynamic shared memory at most
# (N, K) of the 7b decode step's linears -> the fastest tile measured at 32 rows with PDL (H200,
# session 10, `benchmarks/linear/bench_gemm_rows.py --diag` / `--sweep`, calls 9 and 13; cuBLAS in
# brackets, calls 2-3 and 13):
TUNED_TILES = {
    (6144, 4096): Tile(96, 128, 2, 4, rows_per_warp=16),  # qkv: 64 clusters of 2, 17.0 us (18.0)
    (4096, 4096): Tile(64, 256, 2, 4, x_resident=True),  # dense (O): 12.4 us (12.1-12.4), call 13
    (28672, 4096): Tile(224, 128, 1, 3),  # up_proj: 128 single blocks, 57.4 us (60.1-62.3)
    (4096, 14336): Tile(64, 128, 2, 4, rows_per_warp=16),  # down_proj: 35.2 us (31.0-32.0)
}
# The same for the decode QKV with the rotary and K/V write fused in (`rope=`): its tile must hold
# whole heads (block_n % head_dim == 0). Session 10, call 11 (`bench_gemm_rows.py --rope`, 32
# rows): 19.3 us against 21.5 for cuBLAS + fused.rotary_qkv; (128, 128, 4, 2) 19.7, (256, 64, 4,
# 3) 21.2, (128, 128, 2, 4) 22.5.
TUNED_ROPE_TILES = {(6144, 4096): Tile(128, 64, 4, 4, rows_per_warp=16)}
# The weights ([out, in]) that the model runs through gemm_rows at 2..32 rows (`layers.rows_gemm`),
# from one-process A/Bs of 7b batch-32 steps (`ab_decode_step.py`, session 10):
# - up_proj with GeGeLU fused in: 0.05 ms faster than cuBLAS + the GeGeLU kernel (call 5);
# - QKV, at a decode step with the rotary and K/V write fused in: 0.027 ms more (call 11);
# - the output projection with the x-resident tile: 0.013-0.024 ms more (session 11, call 2:
#   10.671 / 10.682 -> 10.658 / 10.658 ms; with session 10's ring tile it lost 0.08 ms, call 10).
# down_proj loses there (session 10, call 10: +0.43 ms). Empty: cuBLAS.
ROWS_LAYERS = {(28672, 4096), (6144, 4096), (4096, 4096)}


def tile_for(n: int, k: int, head_dim: int = 0, sm_count: int = 132) -> Tile:
    """TUNED_TILES's tile, else the one that fills the SMs' waves best (fewest splits, then the
    widest block_n; with `head_dim`, for the rotary epilogue: block_n a multiple of it): untimed."""
    tuned = None if head_dim else TUNED_TILES.get((n, k))
    if tuned is not None:
        return tuned
    best, best_score = None, None
    for split in (1, 2, 4, 8):
        for block_n in range(32, 257, 32):
            tile = Tile(block_n, 64, split, 4)
            try:
                tile.check(n, k)
            except InputError:
                continue
            if head_dim and block_n % head_dim:
                continue
            blocks = n // block_n * split
            waves = -(-blocks // sm_count)
            score = (blocks / (waves * sm_count), -split, block_n)
            if best_score is None or score > best_score:
                best, best_score = tile, score
    if best is None:
        raise InputError(f"no gemm_rows tile divides a [{n}, {k}] weight (N % 32 and K % 64 must be 0)")
    return best


@dataclass(frozen=True)
class Build:
    """Everything that decides one compiled kernel (and the key of its module)."""

    n: int  # W rows
    k: int  # W columns
    dtype: str  # "bf16" | "fp16"
    tile: Tile
    has_bias: bool = True
    gegelu: bool = False  # the GeGeLU epilogue: [M, N / 2] out
    rope: tuple[int, int] | None = None  # (head_dim, group): the decode QKV epilogue (RopeWrite)
    skip_mma: bool = False  # benchmarks only (wrong results): the ring kernel streams its tiles, no math

    def source(self) -> str:
        self.tile.check(self.n, self.k)
        if self.gegelu and self.rope:
            raise InputError("gemm_rows: GeGeLU and rotary epilogues are exclusive")
        d, g = self.rope or (2, 1)
        if self.rope and (d & (d - 1) or self.tile.block_n % d or self.n % ((g + 2) * d)):
            raise InputError(f"gemm_rows rope: head_dim {d} must be a power of two dividing block_n "
                             f"({self.tile.block_n}) and N = {self.n} a multiple of (group + 2) * head_dim")  # fmt: skip
        row = dtypes.resolve(self.dtype, kernel=True)
        t = self.tile
        return render(
            t.template, n=self.n, k=self.k, dtype=row.name, ctype=row.ctype, block_n=t.block_n, block_k=t.block_k,
            split=t.split, stages=t.stages, has_bias=int(self.has_bias), gegelu=int(self.gegelu),
            rope=int(self.rope is not None), head_dim=d, group=g, rows_per_warp=t.rows_per_warp,
            skip_mma=int(self.skip_mma),
        )  # fmt: skip

    def cubin(self, arch: str = ARCH) -> bytes:
        """Compiled with NVRTC for `arch` (no GPU needed)."""
        name = f"gemm_rows_{self.dtype}_n{self.n}_k{self.k}.cu"
        return nb.compile_cubin(self.source(), arch, name=name)[0]


_MODULES: dict[tuple, nb.CubinModule] = {}  # (Build, device index) -> loaded module
_LOCK = threading.Lock()


def _module(build: Build, device: torch.device) -> nb.CubinModule:
    key = (build, device.index)
    mod = _MODULES.get(key)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                with torch.cuda.device(device):
                    mod = nb.CubinModule(build.cubin(), (KERNEL,))
                    mod.allow_shared_memory(KERNEL, build.tile.smem_bytes(build.k))
                _MODULES[key] = mod
    return mod


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
      [M, N / 2], rounded as `layers.gegelu(F.linear(...))` rounds;
    - `rope` (a decode step's QKV, N = Hkv x (G + 2) x D): returns the rotated q [M, Hkv G D]
      and writes the rotated k and v into the caches at each token's slot, rounded as
      `fused.rotary_qkv(F.linear(...))` rounds.
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
    if tile is None:
        tile = TUNED_ROPE_TILES.get((n, k)) or tile_for(n, k, rope_spec[0]) if rope_spec else tile_for(n, k)
    build = Build(n, k, row.name, tile, bias is not None, gegelu, rope_spec, bool(skip_mma))
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
