"""The tl prefill kernel's attention features in Triton's interpreter, against the reference:
sink tokens, soft-cap, learned sinks, a layer's own scale, head dims 32..256.

Run by tests/kernels/test_prefill_features_interpreter.py in a fresh process with
TRITON_INTERPRET=1 (fp16 / fp32 only: the interpreter computes bf16 tl.dot wrongly).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import sparsegen
from sparsegen import HeadSpec, InputError, LayerSpec
from sparsegen.kernels.families.prefill_tl import TritonPrefill
from sparsegen.testing import PrefillProblem, assert_close_rows
from sparsegen.testing_features import FeatureProblem, feature_layers, feature_problems, random_sinks


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")  # NaN-filled outputs: unwritten rows fail
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")


def _check(fp: FeatureProblem) -> None:
    out = sparsegen.prefill(*fp.args(), impl="triton", **fp.kwargs())
    assert_close_rows(out, fp.reference(), context=f"repro: {fp.repro()}")


def _problem(layer, q_lens, k_lens, seed, dtype=torch.float16) -> FeatureProblem:
    return FeatureProblem(
        PrefillProblem(layer, q_lens, k_lens, seed=seed, dtype=dtype), random_sinks(layer, seed)
    )


TL = TritonPrefill()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    feature_problems(
        feature_layers(family=TL, head_dims=(32, 48, 80, 256), block_sizes=(16, 32)), max_len=160
    )
)
def test_fuzzed_feature_specs_match_reference(fp):
    _check(fp)


@pytest.mark.parametrize("head_dim", [32, 48, 80, 256])
def test_gpt_oss_like_window_and_learned_sinks(head_dim):
    layer = LayerSpec(4, 2, head_dim, (HeadSpec(block_size=16, sliding_window=24),) * 4, learned_sinks=True)
    _check(_problem(layer, [70, 1], [130, 41], seed=head_dim))


def test_gemma2_like_softcap_scale_fp32():
    heads = (HeadSpec(block_size=16, sliding_window=30), HeadSpec(block_size=16, dense=True)) * 2
    layer = LayerSpec(4, 2, 256, heads, logit_softcap=5.0, scale=256**-0.5 * 3)
    _check(_problem(layer, [90, 33], [130, 33], seed=2, dtype=torch.float32))


def test_sink_tokens_with_vertical_blocks_not_counted_twice():
    # sink tokens overlap vertical blocks below the near range and the local range itself
    heads = tuple(HeadSpec(block_size=16, local_blocks=1, vert_stride=2, vert_offset=h % 2, sink_tokens=40)
                  for h in range(4))  # fmt: skip
    layer = LayerSpec(4, 1, 64, heads)
    _check(_problem(layer, [200], [200], seed=5))
    _check(_problem(layer, [3, 150], [180, 150], seed=6))


def test_per_head_sink_counts_and_all_features():
    heads = (
        HeadSpec(block_size=32, sliding_window=9, sink_tokens=1),
        HeadSpec(block_size=32, sliding_window=9, sink_tokens=33),
        HeadSpec(block_size=16, local_blocks=2, sink_tokens=4),
        HeadSpec(block_size=16, dense=True),
    )
    layer = LayerSpec(4, 2, 48, heads, logit_softcap=2.0, learned_sinks=True)
    _check(_problem(layer, [120, 17], [120, 60], seed=9))


def test_sinks_argument_is_required_and_refused():
    with_sinks = LayerSpec(2, 1, 32, (HeadSpec(block_size=16, sliding_window=8),) * 2, learned_sinks=True)
    fp = _problem(with_sinks, [20], [20], seed=1)
    with pytest.raises(InputError, match="sinks="):
        sparsegen.prefill(*fp.args(), impl="triton")
    kernel = sparsegen.get_kernel(with_sinks, "prefill", dtype=torch.float16)
    with pytest.raises(InputError, match="sinks"):
        kernel(*fp.args()[:5])
    plain = LayerSpec(2, 1, 32, (HeadSpec(block_size=16, sliding_window=8),) * 2)
    fp2 = _problem(plain, [20], [20], seed=1)
    with pytest.raises(InputError, match="learned_sinks=False"):
        sparsegen.prefill(*fp2.args(), impl="triton", sinks=torch.zeros(2))


def test_a_large_sink_logit_takes_the_mass():
    """A sink logit far above every score leaves almost nothing for the values: out ~ 0."""
    layer = LayerSpec(2, 1, 32, (HeadSpec(block_size=16, sliding_window=8),) * 2, learned_sinks=True)
    fp = _problem(layer, [20], [20], seed=1)
    fp.sinks = torch.tensor([30.0, -30.0])
    out = sparsegen.prefill(*fp.args(), impl="triton", **fp.kwargs())
    assert out[:, 0].abs().max() < 1e-6
    assert out[:, 1].abs().max() > 0.05
    ref = fp.reference()  # head 0's rows are ~1e-13: compare them absolutely, head 1 per row
    torch.testing.assert_close(out[:, 0].double(), ref[:, 0], atol=1e-6, rtol=0)
    assert_close_rows(out[:, 1:], ref[:, 1:])
