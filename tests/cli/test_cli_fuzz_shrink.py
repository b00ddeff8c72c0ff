"""`sparsegen fuzz` lets hypothesis see a failure and shrink it: the report names a minimal
failing example (spec JSON, shapes, data seed) smaller than the first failure found, and one
`--seed` repeats the whole run.

The kernels here are test doubles, stated as such: the reference with one tile made wrong
(query rows 64..127 of every sequence, head 0, for prefill; the second KV page of every
sequence, for decode). The real kernels are not run, so these tests are fast and need no Triton.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch
from click.testing import CliRunner
from hypothesis import strategies as st

from sparsegen import ops, reference
from sparsegen.cli import cli
from sparsegen.commands import fuzz_check
from sparsegen.spec import HeadSpec, LayerSpec
from sparsegen.testing import PrefillProblem, decode_problems, row_mismatch

TILE = 64  # the double's wrong tile: query rows [64, 128) of each sequence, head 0


def one_wrong_tile_prefill(q, k, v, cu_q, cu_k, layer, scale=None, *, impl=None, **kw):
    """A test double of the prefill kernel: right everywhere but one query tile of head 0."""
    out = reference.prefill(q, k, v, cu_q, cu_k, layer, scale, **kw)  # out: [Tq, H, D]
    starts = cu_q.tolist()
    for a, b in zip(starts, starts[1:]):
        out[a + TILE : min(a + 2 * TILE, b), 0] += 0.34
    return out


def one_wrong_page_decode(q, k_cache, v_cache, tables, seq_lens, layer, scale=None, *, impl=None, **kw):
    """A test double of the decode kernel: it attends as if the values of each sequence's
    second page were zero (a wrong page in the gather)."""
    v = v_cache.clone()  # v_cache: [num_pages, page_size, Hkv, D]
    for b in range(tables.shape[0]):
        if int(seq_lens[b]) > v_cache.shape[1]:
            v[int(tables[b, 1])] = 0
    return reference.paged_decode(q, k_cache, v, tables, seq_lens, layer, scale, **kw)


def _fuzz(monkeypatch, *extra: str) -> str:
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "0")
    monkeypatch.setattr(ops, "prefill", one_wrong_tile_prefill)
    args = ["fuzz", "--random", "--kernel", "prefill", "--specs", "1", "--examples", "12",
            "--max-len", "160", *extra]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    return result.output


def _shapes(output: str) -> tuple[list[int], list[int], list[int], list[int]]:
    m = re.search(r"shapes: q_lens=(\[.*?\]) k_lens=(\[.*?\]) \(first failure: q_lens=(\[.*?\]) k_lens=(\[.*?\])\)",
                  output)  # fmt: skip
    assert m, output
    return tuple(ast.literal_eval(g) for g in m.groups())


@pytest.mark.parametrize("seed", ["3", "11"])
def test_one_wrong_tile_is_reported_shrunk(monkeypatch, seed):
    out = _fuzz(monkeypatch, "--seed", seed)
    q, k, first_q, first_k = _shapes(out)
    assert out.count("FAIL prefill (") == 1 and "minimal failing example (prefill, spec 1 of 1" in out
    # the smallest example that reaches the wrong tile: one sequence of 65 queries
    assert q == [TILE + 1] and k == [TILE + 1], out
    assert (len(k), sum(k)) < (len(first_k), sum(first_k)), out
    assert "1 of 65 rows over the per-row tolerance" in out and "worst rows (64, 0)" in out
    assert "data seed: 0" in out and "prefill: " in out and "1 failed" in out
    # the repro line rebuilds the minimal example, and it fails against the double
    spec = re.search(r"  spec: (\{.*\})", out).group(1)
    problem = PrefillProblem(LayerSpec.from_json(spec), q, k, seed=0)
    assert row_mismatch(one_wrong_tile_prefill(*problem.args()), problem.reference()) is not None
    assert row_mismatch(reference.prefill(*problem.args()), problem.reference()) is None


def test_the_seed_repeats_the_run(monkeypatch):
    assert _fuzz(monkeypatch, "--seed", "5") == _fuzz(monkeypatch, "--seed", "5")


def test_no_shrink_reports_the_first_failure(monkeypatch):
    out = _fuzz(monkeypatch, "--seed", "3", "--no-shrink")
    q, k, first_q, first_k = _shapes(out)
    assert (q, k) == (first_q, first_k) and "after 1 shrink step(s)" in out  # the final replay only


def test_a_right_kernel_passes(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "0")
    monkeypatch.setattr(ops, "prefill", lambda *a, impl=None, **kw: reference.prefill(*a, **kw))
    result = CliRunner().invoke(cli, ["fuzz", "--random", "--kernel", "prefill", "--specs", "2", "--examples",
                                      "4", "--max-len", "100", "--seed", "3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "prefill: 8 cases over 2 spec(s), 0 failed" in result.output
    assert "minimal failing example" not in result.output


def test_decode_check_shrinks_a_wrong_page(monkeypatch):
    """The decode half of the check (the CLI runs it on a GPU only) shrinks too."""
    monkeypatch.setattr(ops, "paged_decode", one_wrong_page_decode)
    layer = LayerSpec(
        num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(block_size=16, dense=True),) * 2
    )
    strategy = decode_problems(st.just(layer), max_batch=4, max_len=300, page_sizes=(16,))
    result = fuzz_check.check_spec("decode", strategy, examples=20, dtype=torch.float16, exact=True, seed=1,
                                   shrink=True)  # fmt: skip
    assert result.first is not None and result.minimal is not None
    assert result.minimal.problem.seq_lens == [17], result.minimal.problem.seq_lens  # one token on page 2
    assert fuzz_check.size(result.minimal.problem) < fuzz_check.size(result.first.problem)
    assert result.shrink_steps > 1 and not result.flaky
    lines = fuzz_check.report("decode", 1, 1, 1, result)
    assert "seq_lens=[17] page_size=16" in lines[2] and '"num_kv_heads":1' in lines[1]


def test_a_kernel_error_is_a_failure_and_is_shrunk(monkeypatch):
    def raises_past_100(q, *args, impl=None, **kw):
        if q.shape[0] > 100:
            raise RuntimeError("out of shared memory\nsecond line")
        return reference.prefill(q, *args, **kw)

    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "0")
    monkeypatch.setattr(ops, "prefill", raises_past_100)
    result = CliRunner().invoke(cli, ["fuzz", "--random", "--kernel", "prefill", "--specs", "1", "--examples",
                                      "12", "--max-len", "160", "--seed", "3"])  # fmt: skip
    assert result.exit_code == 1, result.output
    q, k, _, _ = _shapes(result.output)
    assert sum(q) == 101 and "RuntimeError: out of shared memory" in result.output
    assert "second line" not in result.output


def test_feature_problems_shrink_and_report(monkeypatch):
    """--features draws FeatureProblems (a PrefillProblem plus learned sinks): they shrink and
    report the same way, sinks passed to the kernel double."""
    from sparsegen.testing_features import feature_problems

    monkeypatch.setattr(ops, "prefill", one_wrong_tile_prefill)
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=32, heads=(HeadSpec(block_size=16, dense=True),) * 2,
                      learned_sinks=True)  # fmt: skip
    strategy = feature_problems(st.just(layer), max_batch=2, max_len=150)
    result = fuzz_check.check_spec("prefill", strategy, examples=15, dtype=torch.float16, exact=True, seed=2,
                                   shrink=True)  # fmt: skip
    assert result.first is not None and result.minimal is not None
    assert result.minimal.problem.problem.q_lens == [TILE + 1]
    lines = fuzz_check.report("prefill", 1, 1, 2, result)
    assert '"learned_sinks":true' in lines[1] and "q_lens=[65]" in lines[2] and "sinks=[" in lines[4]
