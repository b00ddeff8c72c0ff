"""The wider strategies of sparsegen.testing draw the regions they promise (block size 256, k_len 0
and q_len 0 inside a batch, 8 KV heads, group size 8, scores near +-50..100), and the prefill
kernel (Triton's interpreter) matches the reference per row on such cases."""

from __future__ import annotations

import pytest
import torch
from helpers.interpreter import assert_cases_pass
from hypothesis import HealthCheck, find, settings

from sparsegen.testing import PrefillProblem, prefill_problems, wide_layer_specs

FIND = settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck))
SMALL = {"head_dims": (64,)}


def test_wide_layers_draw_block_256_8_kv_heads_and_group_8():
    layers = wide_layer_specs(**SMALL)
    assert find(layers, lambda ls: any(h.block_size == 256 for h in ls.heads), settings=FIND)
    assert find(layers, lambda ls: ls.num_kv_heads == 8, settings=FIND).num_kv_heads == 8
    grouped = find(layers, lambda ls: ls.num_heads // ls.num_kv_heads == 8, settings=FIND)
    assert grouped.num_heads == 8 * grouped.num_kv_heads


def test_empty_sequences_are_drawn_inside_a_batch():
    problems = prefill_problems(wide_layer_specs(**SMALL), max_len=20, empty=True)
    k0 = find(problems, lambda p: 0 in p.k_lens, settings=FIND)
    q0 = find(problems, lambda p: any(q == 0 < k for q, k in zip(p.q_lens, p.k_lens)), settings=FIND)
    assert 0 in k0.k_lens and any(k > 0 for k in k0.k_lens)  # never a batch of nothing
    assert any(q == 0 < k for q, k in zip(q0.q_lens, q0.k_lens))


def _max_score(p: PrefillProblem) -> float:
    t = p.tensors
    k = t["k"].double().repeat_interleave(p.layer.num_heads // p.layer.num_kv_heads, dim=1)
    return float(torch.einsum("qhd,khd->hqk", t["q"].double(), k).abs().max()) * p.scale


def test_large_logits_reach_scores_of_50_and_the_reference_stays_finite():
    problems = prefill_problems(wide_layer_specs(**SMALL), max_len=30, large_logits=True)
    p = find(problems, lambda p: _max_score(p) >= 50, settings=FIND)
    assert torch.isfinite(p.reference()).all()


@pytest.mark.slow
def test_the_interpreter_kernel_on_the_wide_region():
    """The cases run in a fresh process: TRITON_INTERPRET=1 works only before Triton's first import."""
    assert_cases_pass("toolkit/interpreter_wide_cases.py")
