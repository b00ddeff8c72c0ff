"""`sparsegen generate` and `serve` `--kv-cache-dtype`: fp8 on the CPU path, bad values refused by click."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparsegen.cli import cli

pytestmark = pytest.mark.usefixtures("single_thread")


def run(*args):
    return CliRunner().invoke(cli, ["generate", *args], catch_exceptions=False)


def greedy(*extra):
    res = run("--random", "tiny", "--prompt-ids", "5,17,99,3,250,41,8,8,120", "--max-tokens", "6", "--json",
              "--device", "cpu", "--no-warmup", *extra)  # fmt: skip
    assert res.exit_code == 0, res.output
    return res


def test_random_tiny_fp8_kv_cache_runs_and_matches_the_fp32_cache():
    fp8 = greedy("--kv-cache-dtype", "fp8")
    assert "float8_e4m3fn" in fp8.stderr  # the cache's log line names its dtype
    auto = greedy()
    assert "torch.float32" in auto.stderr
    got, want = json.loads(fp8.stdout)["output_ids"], json.loads(auto.stdout)["output_ids"]
    assert len(got) == 6
    assert got[:4] == want[:4]


@pytest.mark.parametrize("value", ["fp16", "int8", "FP8", ""])
def test_bad_kv_cache_dtype_is_a_usage_error(value):
    res = CliRunner().invoke(cli, ["generate", "--random", "tiny", "--prompt-ids", "1", "--device", "cpu",
                                   "--kv-cache-dtype", value])  # fmt: skip
    assert res.exit_code == 2
    assert "--kv-cache-dtype" in res.output


def test_serve_passes_kv_cache_dtype_to_the_llm(monkeypatch):
    pytest.importorskip("fastapi")
    import sparsegen.llm
    from sparsegen.errors import InputError

    seen = {}

    def fake_llm(**kw):
        seen.update(kw)
        raise InputError("stopped before the model is built")

    monkeypatch.setattr(sparsegen.llm, "LLM", fake_llm)
    res = CliRunner().invoke(
        cli, ["serve", "--random", "tiny", "--device", "cpu", "--kv-cache-dtype", "fp8_e5m2"]
    )
    assert res.exit_code == 2 and "stopped before the model is built" in res.output
    assert seen["kv_cache_dtype"] == "fp8_e5m2"


def test_serve_refuses_a_bad_kv_cache_dtype():
    res = CliRunner().invoke(cli, ["serve", "--random", "tiny", "--kv-cache-dtype", "bf16"])
    assert res.exit_code == 2 and "--kv-cache-dtype" in res.output
