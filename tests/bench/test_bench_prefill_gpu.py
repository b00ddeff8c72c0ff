"""GPU tier for `sparsegen bench --kind prefill`'s rows: one short run of each case's layer, every
peer that ran agreeing with sparsegen's output (FA4's window and sink arguments included), and
the rows in the JSON form the summary reads. Without `flash_attn.cute` FA4 and the FLASH
backend must read "n/a (flash_attn.cute not installed)"; with it, FA4 must have run on the
dense, window and gpt-oss layers."""

from __future__ import annotations

import json

import pytest

from sparsegen.commands.bench import cases, peers, prefill
from sparsegen.commands.bench.common import measure_ceilings

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(cases.LAYERS))
def test_bench_row_of_each_case(name):
    layer = cases.LAYERS[name]()
    row = json.loads(json.dumps(prefill.bench_case(layer, 2048, measure_ceilings())))
    assert set(row["peers"]) == set(cases.PEERS)
    assert cases.is_time(row["sparsegen_ms"]) and 0 < row["of_ceiling"]["sparsegen"] < 1.2
    fa4_here = not isinstance(peers.fa4_module(), str)
    for peer, value in row["peers"].items():
        if cases.is_time(value):
            assert row[f"rel_err_vs_{peer}"] < 2e-2, (peer, row)
        else:
            assert value.startswith("n/a ("), (peer, value)
    if not fa4_here:
        assert row["peers"]["fa4"] == row["peers"]["flex_flash"] == peers.NOT_INSTALLED
    elif name in ("dense", "window", "gpt-oss"):
        assert cases.is_time(row["peers"]["fa4"]), row["peers"]["fa4"]
    if row["best_peer"] is not None:
        best = row["peers"][row["best_peer"]]
        assert row["x_best_peer"] == pytest.approx(best / row["sparsegen_ms"])
