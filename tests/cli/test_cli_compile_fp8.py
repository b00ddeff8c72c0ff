"""`sparsegen compile --kv-cache-dtype fp8` builds the fp8 decode kernels ahead of time (sm_90, no
GPU) under names that say fp8, and `sparsegen show --kv-cache-dtype` states the KV dtype."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import extras

from sparsegen.cli import cli


def _compile(*extra):
    result = CliRunner().invoke(cli, ["compile", "--pattern", "dense", "--arch", "sm_90", "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_compile_fp8_decode_kernels_ahead_of_time(fresh_cache):
    extras.require("cuda.core")
    fp8 = _compile("--kind", "decode", "--kv-cache-dtype", "fp8")
    assert [r["status"] for r in fp8] == ["compiled"]
    assert fp8[0]["name"].startswith("decode_bf16_kvfp8e4m3_hd")
    listing = json.loads(CliRunner().invoke(cli, ["cache", "ls", "--json"]).stdout)
    assert [e["meta"].get("kv_dtype") for e in listing] == ["fp8e4m3"]
    assert "bf16 kv fp8e4m3" in CliRunner().invoke(cli, ["cache", "ls"]).stdout
    again = _compile("--kind", "decode", "--kv-cache-dtype", "fp8_e4m3")  # the same kernel, cached
    assert [r["status"] for r in again] == ["cached"] and again[0]["key"] == fp8[0]["key"]
    e5 = _compile("--kind", "decode", "--kv-cache-dtype", "fp8_e5m2", "--dtype", "fp16")
    assert e5[0]["name"].startswith("decode_fp16_kvfp8e5m2_hd") and e5[0]["status"] == "compiled"


def test_compile_refuses_fp8_for_an_arch_without_it(fresh_cache):
    result = CliRunner().invoke(
        cli,
        ["compile", "--pattern", "dense", "--arch", "sm_80", "--kind", "decode", "--kv-cache-dtype", "fp8"],
    )
    assert result.exit_code != 0
    assert "sm_89" in result.output
    bad = CliRunner().invoke(cli, ["compile", "--pattern", "dense", "--kv-cache-dtype", "int8"])
    assert bad.exit_code == 2 and "kv-cache-dtype" in bad.output


def test_show_states_the_kv_dtype():
    runner = CliRunner()
    text = runner.invoke(
        cli, ["show", "--pattern", "phi3small", "--seq-len", "256", "--kv-cache-dtype", "fp8"]
    )
    assert text.exit_code == 0, text.output
    assert (
        "KV cache dtype: fp8 (float8_e4m3fn); decode kernel (bf16 q): decode_bf16_kvfp8e4m3_hd128_ps16_g4_bs64_l16_v8"
        in text.output
    )
    data = json.loads(
        runner.invoke(cli, ["show", "--pattern", "phi3small", "--seq-len", "256", "--json"]).stdout
    )
    assert (
        data["kv_cache_dtype"] == "auto" and data["decode_kernel"] == "decode_bf16_hd128_ps16_g4_bs64_l16_v8"
    )
    e5 = json.loads(
        runner.invoke(
            cli,
            ["show", "--pattern", "phi3small", "--seq-len", "256", "--json", "--kv-cache-dtype", "fp8_e5m2"],
        ).stdout
    )
    assert e5["kv_torch_dtype"] == "float8_e5m2" and "_kvfp8e5m2_" in e5["decode_kernel"]
