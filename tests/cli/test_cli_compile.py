"""`sparsegen compile`, `cache` and `fuzz` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparsegen.cli import cli
from sparsegen.jit import triton_build
from sparsegen.kernels import prefill as prefill_mod


@pytest.fixture(autouse=True)
def _fresh(fresh_cache):
    yield fresh_cache


def _compile(*extra):
    result = CliRunner().invoke(
        cli, ["compile", "--pattern", "phi3small", "--arch", "sm_90", "--json", *extra]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_compile_then_cached_without_building(monkeypatch):
    first = _compile("--kind", "prefill")
    assert [r["status"] for r in first] == ["compiled", "compiled"]  # one sparse + one dense layer kind
    assert set(first[0]) == {"kind", "name", "key", "arch", "status", "seconds", "path"}
    prefill_mod.forget()  # a new process would start with an empty memory layer

    def no_build(*args, **kwargs):
        raise AssertionError("a cached kernel was compiled again")

    monkeypatch.setattr(triton_build, "aot_compile", no_build)
    second = _compile("--kind", "prefill")
    assert [r["status"] for r in second] == ["cached", "cached"]
    assert [r["key"] for r in second] == [r["key"] for r in first]


def test_compile_table_and_bad_pattern():
    result = CliRunner().invoke(
        cli, ["compile", "--pattern", "phi3small", "--arch", "sm_80", "--kind", "prefill"]
    )
    assert result.exit_code == 0, result.output
    assert "prefill_bf16_hd128_h32kv8_bs64_l16_v8" in result.stdout
    bad = CliRunner().invoke(cli, ["compile", "--pattern", "no-such-pattern"])
    assert bad.exit_code == 2


def test_cache_dir_ls_clear(fresh_cache):
    runner = CliRunner()
    assert runner.invoke(cli, ["cache", "dir"]).stdout.strip() == str(fresh_cache)
    _compile("--kind", "prefill")
    listing = json.loads(runner.invoke(cli, ["cache", "ls", "--json"]).stdout)
    assert len(listing) == 2 and {e["meta"]["kind"] for e in listing} == {"prefill"}
    assert "removed 2 entries" in runner.invoke(cli, ["cache", "clear", "--yes"]).stdout
    assert "is empty" in runner.invoke(cli, ["cache", "ls"]).stdout


def test_fuzz_needs_exactly_one_source():
    assert CliRunner().invoke(cli, ["fuzz"]).exit_code == 2


def test_fuzz_in_process_leaves_the_environment_alone(monkeypatch):
    """`sparsegen fuzz` sets TRITON_INTERPRET / SPARSEGEN_POISON_OUTPUT for its own run only."""
    import os

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPARSEGEN_POISON_OUTPUT", raising=False)
    before = dict(os.environ)
    args = ["fuzz", "--random", "--kernel", "prefill", "--specs", "1", "--examples", "1", "--max-len", "8"]
    CliRunner().invoke(cli, args)  # it may run, or refuse (Triton imported before the flag was set)
    assert dict(os.environ) == before
