"""The benchmark summary tables (its FlexAttention mask is sparsegen.flex: tests/toolkit/test_flex.py)."""

from __future__ import annotations


def test_bench_summary_reads_a_recorded_h200_run():
    """The summary tables of `sparsegen bench` (GPU only) render from a run's recorded JSON."""
    import json
    from pathlib import Path

    from sparsegen.commands.bench import SUMMARY_COLUMNS
    from sparsegen.commands.table import format_table

    run = json.loads(
        (Path(__file__).parents[2] / "benchmarks/results/bench/bench_h200_run2.json").read_text()
    )
    for kind, columns in SUMMARY_COLUMNS.items():
        table = format_table([n for n, _ in columns], [[get(r) for _, get in columns] for r in run[kind]])
        assert len(table.splitlines()) == 1 + len(run[kind]) > 1
    first = run["decode"][0]
    speedup = dict(SUMMARY_COLUMNS["decode"])["x_sdpa"](first)
    assert speedup == first["sdpa_dense_us"] / first["sparsegen_us"] > 1
