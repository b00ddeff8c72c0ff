"""The tl prefill kernel on narrow windows (prefill_template.narrow_config: packed GQA heads,
narrow key tiles) in Triton's interpreter, against the reference row by row, NaN-poisoned outputs.

Run by tests/kernels/test_prefill_narrow_interpreter.py in a fresh process with
TRITON_INTERPRET=1 (fp16 / fp32 only: the interpreter computes bf16 tl.dot wrongly).
"""

from __future__ import annotations

import pytest
import torch

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels import prefill as prefill_mod
from sparsegen.kernels import prefill_template as tpl
from sparsegen.kernels.prefill import get_prefill_kernel
from sparsegen.testing import PrefillProblem, assert_close_rows
from sparsegen.testing_features import FeatureProblem, random_sinks


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")  # NaN-filled outputs: unwritten rows fail
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")


def _layer(window: int, *, hkv: int = 1, group: int = 8, sinks: bool = False, **extra) -> LayerSpec:
    head = HeadSpec(block_size=16, sliding_window=window, sink_tokens=extra.pop("sink_tokens", 0))
    return LayerSpec(hkv * group, hkv, extra.pop("head_dim", 32), (head,) * (hkv * group), learned_sinks=sinks,
                     **extra)  # fmt: skip


def _check(layer, q_lens, k_lens, seed, dtype=torch.float16, pack=1):
    kernel = get_prefill_kernel(layer, dtype=dtype, arch="interpreter")
    assert kernel.config.get("pack", 1) == pack, kernel.config  # the narrow rule did apply
    fp = FeatureProblem(
        PrefillProblem(layer, q_lens, k_lens, seed=seed, dtype=dtype), random_sinks(layer, seed)
    )
    out = sparsegen.prefill(*fp.args(), impl="triton", **fp.kwargs())
    assert_close_rows(out, fp.reference(), context=f"repro: {fp.repro()}")


@pytest.mark.parametrize("window", [16, 64, 128])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "learned_sinks"])
def test_gqa_8_to_1_packed_windows_match_reference(window, sinks):
    # lengths cross tile edges (4 positions per packed tile), a prefix (q_len < k_len), one query
    _check(_layer(window, sinks=sinks), [150, 1, 37], [150, 90, 300], seed=window + sinks, pack=8)


def test_fp32_two_kv_heads_window_64_sinks():
    _check(_layer(64, hkv=2, sinks=True), [70, 33], [200, 33], seed=2, dtype=torch.float32, pack=8)


def test_group_16_packs_8_heads_twice_per_kv_head():
    _check(_layer(24, hkv=2, group=16, sinks=True), [45], [120], seed=3, pack=8)


def test_group_6_packs_2_and_group_1_does_not_pack():
    _check(_layer(40, hkv=1, group=6, sinks=True), [60, 9], [100, 9], seed=4, pack=2)
    _check(_layer(40, hkv=3, group=1, sinks=True), [60], [100], seed=5, pack=1)


def test_sink_tokens_soft_cap_and_head_dim_48_packed():
    layer = _layer(32, hkv=1, group=4, sink_tokens=5, logit_softcap=3.0, head_dim=48, scale=0.2)
    _check(layer, [130, 2], [130, 77], seed=6, pack=4)


def test_the_gpu_tile_shape_in_the_interpreter(monkeypatch):
    """sm_90's packed shape: BLOCK_M 128 = 8 heads x 16 positions, BLOCK_N 32 (gpt-oss at hd 64)."""
    gpu = {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3}
    monkeypatch.setattr(tpl, "pick_config", lambda *a: dict(gpu))
    prefill_mod.forget()
    try:
        layer = _layer(128, sinks=True, head_dim=64)
        kernel = get_prefill_kernel(layer, dtype=torch.float16, arch="interpreter")
        assert {k: kernel.config[k] for k in ("block_m", "block_n", "pack")} == {"block_m": 128, "block_n": 32,
                                                                                  "pack": 8}  # fmt: skip
        _check(layer, [300, 17], [300, 200], seed=7, pack=8)
    finally:
        prefill_mod.forget()
