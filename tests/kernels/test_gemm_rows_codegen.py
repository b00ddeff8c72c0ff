"""CPU tier for `kernels.linear.gemm_rows`: its templates render and compile for sm_90 with NVRTC (no GPU
needed) within the register file and without spills, tiles are checked before anything is
built, and CPU tensors are refused with a typed error."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import extras
from helpers.ptxas import ptxas_report

from sparsegen.errors import InputError
from sparsegen.kernels.linear import gemm_rows as gr
from sparsegen.kernels.linear import gemm_rows_tiles as tiles
from sparsegen.kernels.linear.gemm_rows_tiles import Tile
from sparsegen.models.layers import rows_gemm

extras.require("cuda.core")


@pytest.mark.parametrize("shape", sorted(tiles.TUNED_TILES))
@pytest.mark.parametrize("gegelu", [False, True])
def test_tuned_builds_fit_without_spills(shape, gegelu):
    n, k = shape
    tile = tiles.TUNED_TILES[shape]
    report = ptxas_report(gr.Build(n, k, "bf16", tile, True, gegelu).source(), "sm_90")
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs * tile.threads() <= 65536, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    assert tile.smem_bytes(k) <= tiles.SMEM_LIMIT


def test_fp16_both_kernels_and_every_epilogue_compile():
    for tile in (
        Tile(128, 128, 2, 3),
        Tile(128, 128, 4, 3, x_resident=True),
        Tile(128, 64, 4, 4, rows_per_warp=16),
    ):
        for gegelu, rope in ((False, None), (True, None), (False, (64, 2))):
            assert (
                gr.lookup(gr.Build(512, 1024, "fp16", tile, False, gegelu, rope)).kernel.cubin[:4]
                == b"\x7fELF"
            )


def test_bad_epilogues_are_refused():
    tile = Tile(64, 64, 1, 2)
    with pytest.raises(InputError, match="exclusive"):
        gr.Build(512, 1024, "bf16", tile, gegelu=True, rope=(64, 2)).source()
    with pytest.raises(InputError, match="power of two dividing block_n"):
        gr.Build(512, 1024, "bf16", tile, rope=(128, 2)).source()  # a head wider than the tile
    with pytest.raises(InputError, match="power of two"):
        gr.Build(576, 1024, "bf16", Tile(96, 64, 1, 2), rope=(48, 2)).source()


@pytest.mark.parametrize(
    "tile,match",
    [
        (Tile(48, 64, 1, 3), "block_n % 32"),
        (Tile(64, 96, 1, 3), "block_k % 64"),
        (Tile(64, 64, 3, 3), "split in"),
        (Tile(64, 64, 1, 1), "stages >= 2"),
        (Tile(96, 64, 1, 3), "does not divide"),
        (Tile(256, 512, 1, 8), "shared memory"),
        (Tile(64, 64, 1, True), "positive int"),
    ],
)
def test_bad_tiles_are_refused(tile, match):
    with pytest.raises(InputError, match=match):
        tile.check(512, 4096)


def test_tile_for_fills_the_gpu():
    for (n, k), tile in tiles.TUNED_TILES.items():
        assert tiles.tile_for(n, k) is tile
    tile = tiles.tile_for(2048, 2048)
    tile.check(2048, 2048)
    assert 2048 // tile.block_n * tile.split <= 132
    with pytest.raises(InputError, match="no gemm_rows tile"):
        tiles.tile_for(100, 64)


def test_cpu_tensors_are_refused_and_the_model_keeps_cublas():
    x, w = torch.randn(4, 512), torch.randn(256, 512)
    with pytest.raises(InputError, match="sm_90"):
        gr.gemm_rows(x, w)
    layer = torch.nn.Linear(4096, 28672, bias=True, device="meta")
    assert not rows_gemm(layer, torch.randn(8, 4096), True)
