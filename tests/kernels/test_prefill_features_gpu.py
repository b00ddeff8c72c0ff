"""GPU tier for the tl prefill kernel's attention features: bf16 and fp16 against the reference
per row, NaN-poisoned outputs, on fuzzed specs with sink tokens, soft-cap, learned sinks, a
layer scale and head dims 32..256, plus the gpt-oss and Gemma-2 layers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels.families.prefill_tl import TritonPrefill
from sparsegen.testing import PrefillProblem, assert_close_rows
from sparsegen.testing_features import FeatureProblem, feature_layers, feature_problems, random_sinks

pytestmark = pytest.mark.gpu

LAYERS = feature_layers(family=TritonPrefill(), head_dims=(32, 48, 64, 80, 128, 160, 256), max_kv_heads=4)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")


def _check(fp: FeatureProblem) -> None:
    out = sparsegen.prefill(*fp.args(), impl="triton", **fp.kwargs())
    assert not out.isnan().any(), fp.repro()
    assert_close_rows(out.cpu(), fp.reference(), dtype=fp.problem.dtype, context=f"repro: {fp.repro()}")


def _cuda(layer, q_lens, k_lens, seed, dtype) -> FeatureProblem:
    problem = PrefillProblem(layer, q_lens, k_lens, seed=seed, dtype=dtype, device="cuda")
    return FeatureProblem(problem, random_sinks(layer, seed, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=12, deadline=None)
@given(data=feature_problems(LAYERS, max_batch=3, max_len=700))
def test_fuzzed_feature_specs(dtype, data):
    p = data.problem
    _check(_cuda(p.layer, p.q_lens, p.k_lens, p.seed, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_layer(dtype):
    layer = LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True)
    _check(_cuda(layer, [1000, 37], [1000, 300], seed=1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma2_layer(dtype):
    heads = (HeadSpec(block_size=64, sliding_window=4096),) * 16
    layer = LayerSpec(16, 8, 256, heads, logit_softcap=50.0, scale=256**-0.5)
    _check(_cuda(layer, [900, 5], [900, 700], seed=2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streaming_sink_tokens(dtype):
    heads = (HeadSpec(block_size=64, sliding_window=256, sink_tokens=4),) * 8
    _check(_cuda(LayerSpec(8, 2, 128, heads), [1500], [1500], seed=3, dtype=dtype))
