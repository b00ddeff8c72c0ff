"""GPU tier for the tl prefill on narrow windows (prefill_template.narrow_config): packed GQA heads
and 32-key tiles, bf16 and fp16 against the reference per row, NaN-poisoned outputs, on the
gpt-oss layer and windows 16 / 64 / 128 with GQA 8:1, learned sinks, and without GQA."""

from __future__ import annotations

import pytest
import torch

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels.prefill import get_prefill_kernel
from sparsegen.testing import PrefillProblem, assert_close_rows
from sparsegen.testing_features import FeatureProblem, random_sinks

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")


def _layer(window: int, heads: int, kv: int, head_dim: int, sinks: bool) -> LayerSpec:
    return LayerSpec(heads, kv, head_dim, (HeadSpec(block_size=64, sliding_window=window),) * heads,
                     learned_sinks=sinks)  # fmt: skip


def _check(layer, q_lens, k_lens, seed, dtype, pack):
    kernel = get_prefill_kernel(layer, dtype=dtype, variant="tl")
    assert kernel.config.get("pack", 1) == pack, kernel.config
    problem = PrefillProblem(layer, q_lens, k_lens, seed=seed, dtype=dtype, device="cuda")
    fp = FeatureProblem(problem, random_sinks(layer, seed, device="cuda"))
    out = sparsegen.prefill(*fp.args(), impl="triton", **fp.kwargs())
    assert not out.isnan().any(), fp.repro()
    assert_close_rows(out.cpu(), fp.reference(), dtype=dtype, context=f"repro: {fp.repro()}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_layer(dtype):
    layer = _layer(128, 64, 8, 64, True)
    _check(layer, [2048, 1, 300], [2048, 700, 1000], seed=1, dtype=dtype, pack=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [16, 64, 128])
@pytest.mark.parametrize("sinks", [False, True])
def test_gqa_8_to_1_windows(dtype, window, sinks):
    layer = _layer(window, 16, 2, 128, sinks)
    _check(layer, [777, 33], [1500, 33], seed=window, dtype=dtype, pack=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_gqa_narrow_tiles(dtype):
    layer = _layer(100, 4, 4, 64, True)
    _check(layer, [999, 64], [999, 200], seed=3, dtype=dtype, pack=1)
    assert get_prefill_kernel(layer, dtype=dtype, variant="tl").config["block_m"] == 64
