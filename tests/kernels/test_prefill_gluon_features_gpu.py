"""GPU tier for the Gluon (sm_90) prefill's layer features: soft-cap, learned sinks, sink tokens and
head_dim 48..256 through `variant="gluon"`, bf16 and fp16, against the reference per (row, head)
with NaN-poisoned outputs. Twelve compiled kernels in all (each (spec, dtype) is one): the gpt-oss
and Gemma-2 layers in both dtypes, hd 256 dense causal, sink tokens with a window, and six fuzzed
feature specs drawn from what the Gluon family declares, each run on several shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hseed

from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels import prefill_gluon_template as tpl
from sparsegen.kernels.families.prefill_gluon import GluonPrefill
from sparsegen.kernels.prefill_gluon import get_gluon_prefill_kernel
from sparsegen.testing import PrefillProblem, assert_close_rows
from sparsegen.testing_features import FeatureProblem, feature_layers, random_sinks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
        reason="the Gluon prefill kernel runs on sm_90 (Hopper) only",
    ),
]

GPT_OSS = LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True)
GEMMA2 = LayerSpec(16, 8, 256, (HeadSpec(block_size=64, sliding_window=4096),) * 16, logit_softcap=50.0,
                   scale=256**-0.5)  # fmt: skip
DENSE256 = LayerSpec(16, 8, 256, (HeadSpec(dense=True),) * 16)
STREAM = LayerSpec(8, 2, 128, (HeadSpec(block_size=64, sliding_window=256, sink_tokens=4),) * 8)
# (q_lens, k_lens): whole prompts, a cached prefix, one-token queries, lengths off the tiles
SHAPES = ([[1000, 37], [1000, 300]], [[900, 5], [900, 700]], [[1], [130]], [[257, 64], [257, 64]])


def _fuzzed(count: int = 6) -> list[LayerSpec]:
    """`count` feature layers the Gluon kernel covers, reproducibly (a fixed hypothesis seed)."""
    out: dict[tuple, LayerSpec] = {}  # one layer per feature set, head dims in turn (padded ones too)
    dims = (48, 80, 160, 256, 64, 128, 112, 224)

    @hseed(29)
    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(feature_layers(family=GluonPrefill(), max_kv_heads=4))
    def draw(layer):
        layer = replace(layer, head_dim=dims[len(out) % len(dims)])
        key = (layer.features, len(out) // 4)  # each feature set at most once per 4 layers
        if len(out) < count and tpl.covers(layer, "bf16") is None and layer.features and key not in out:
            out[key] = layer

    draw()
    return list(out.values())


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")


def _check(layer: LayerSpec, dtype: torch.dtype, shapes=SHAPES) -> None:
    kernel = get_gluon_prefill_kernel(layer, dtype=dtype)
    assert kernel.request.variant == "gluon"
    for seed, (q_lens, k_lens) in enumerate(shapes):
        problem = PrefillProblem(layer, q_lens, k_lens, seed=seed, dtype=dtype, device="cuda")
        fp = FeatureProblem(problem, random_sinks(layer, seed, device="cuda"))
        out = kernel(*fp.args(), **fp.kwargs())
        assert not out.isnan().any(), f"{kernel.name}: unwritten rows; repro: {fp.repro()}"
        assert_close_rows(
            out.cpu(), fp.reference(), dtype=dtype, context=f"{kernel.name}; repro: {fp.repro()}"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt_oss_layer(dtype):
    _check(GPT_OSS, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma2_layer(dtype):
    _check(GEMMA2, dtype)


def test_hd256_dense_causal():
    _check(DENSE256, torch.bfloat16)


def test_sink_tokens_with_a_window():
    _check(STREAM, torch.float16, SHAPES + ([[1500], [1500]],))


def test_fuzzed_feature_specs():
    layers = _fuzzed()
    assert len(layers) == 6, f"drew {len(layers)} covered feature layers"
    for i, layer in enumerate(layers):
        _check(layer, (torch.bfloat16, torch.float16)[i % 2], SHAPES[:3])
