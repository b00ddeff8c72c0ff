"""The benchmark's FlexAttention mask_mod must be the same pattern as DESIGN §1."""

from __future__ import annotations

import torch
from hypothesis import given

import sparsegen as sg
from sparsegen.bench.common import flex_mask_mod
from sparsegen.testing import layer_specs


@given(layer_specs(hybrid=True))
def test_flex_mask_mod_equals_visible_mask_hybrid(layer):
    _check(layer, 150, 200)


def test_flex_mask_mod_equals_visible_mask_phi3small():
    _check(sg.get_pattern("phi3small").layers[0], 1200, 1500)


def _check(layer, n_q, n_k):
    mod = flex_mask_mod(layer, n_q, n_k, "cpu")
    q_idx, kv_idx = torch.arange(n_q).view(n_q, 1), torch.arange(n_k).view(1, n_k)
    expected = sg.visible_mask(layer, n_q, n_k)
    for h in range(layer.num_heads):
        got = mod(torch.tensor(0), torch.tensor(h), q_idx, kv_idx)
        assert torch.equal(got.expand(n_q, n_k), expected[h]), h


def test_bench_summary_reads_a_recorded_h200_run():
    """The summary tables of `sparsegen bench` (GPU only) render from a run's recorded JSON."""
    import json
    from pathlib import Path

    from sparsegen.bench.common import format_table
    from sparsegen.commands.bench import SUMMARY_COLUMNS

    run = json.loads((Path(__file__).parents[1] / "benchmarks/results/bench_h200_run2.json").read_text())
    for kind, columns in SUMMARY_COLUMNS.items():
        table = format_table([n for n, _ in columns], [[get(r) for _, get in columns] for r in run[kind]])
        assert len(table.splitlines()) == 1 + len(run[kind]) > 1
    first = run["decode"][0]
    speedup = dict(SUMMARY_COLUMNS["decode"])["x_sdpa"](first)
    assert speedup == first["sdpa_dense_us"] / first["sparsegen_us"] > 1
