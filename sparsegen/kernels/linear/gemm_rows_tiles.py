"""The tiles of the few-row CUDA GEMM (`linear.gemm_rows`): their shape, their checks, the ones
measured fastest on the H200 for the 7b shapes, and the rule for other shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InputError

MAX_ROWS = 32  # rows of x one launch takes (the tile's MMA N side)


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
# (N, K) of the 7b decode step's linears -> the fastest tile measured at 32 rows with PDL on the
# H200 (`benchmarks/linear/bench_gemm_rows.py --diag` / `--sweep`; cuBLAS in brackets):
TUNED_TILES = {
    (6144, 4096): Tile(96, 128, 2, 4, rows_per_warp=16),  # qkv: 64 clusters of 2, 17.0 us (18.0)
    (4096, 4096): Tile(64, 256, 2, 4, x_resident=True),  # dense (O): 12.4 us (12.1-12.4)
    (28672, 4096): Tile(224, 128, 1, 3),  # up_proj: 128 single blocks, 57.4 us (60.1-62.3)
    (4096, 14336): Tile(64, 128, 2, 4, rows_per_warp=16),  # down_proj: 35.2 us (31.0-32.0)
}
# The same for the decode QKV with the rotary and K/V write fused in (`rope=`): its tile must hold
# whole heads (block_n % head_dim == 0). `bench_gemm_rows.py --rope` at 32 rows: 19.3 us against
# 21.5 for cuBLAS + fused.rotary.rotary_qkv; (128, 128, 4, 2) 19.7, (256, 64, 4, 3) 21.2, (128,
# 128, 2, 4) 22.5.
TUNED_ROPE_TILES = {(6144, 4096): Tile(128, 64, 4, 4, rows_per_warp=16)}


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
