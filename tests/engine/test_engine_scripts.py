"""The engine's GPU scripts on a CPU: they parse their arguments, and the profile script's
`--smoke` mode runs its whole CPU path (tiny model) and writes the JSON the GPU call reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts a script in a fresh interpreter
ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_engine_script_is_valid_bash(tmp_path):
    r = _run(["bash", "-n", "benchmarks/gpu_engine.sh"], tmp_path)
    assert r.returncode == 0, r.stderr


def test_profile_decode_step_smoke_writes_its_json(tmp_path):
    out = tmp_path / "p.json"
    r = _run([sys.executable, "benchmarks/engine/profile_decode_step.py", "--smoke", "--batch", "2", "--steps", "1",
              "--context", "20", "--json", str(out)], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["batch"] == 2 and report["size"] == "tiny"
    assert report["CUDA graphs"]["step_ms"] > 0 and report["CUDA graphs"]["replay_ms"] is None  # no GPU
    assert report["eager_step_ms"] > 0
    assert report["aten_ops_per_step"]["aten::addmm"] >= 2 * 4  # 2 tiny layers x 4 linears, at least
    assert "aten ops per eager step" in r.stdout


def test_bench_prefix_cache_smoke_compares_caching_off_and_on(tmp_path):
    out = tmp_path / "pc.json"
    r = _run(
        [sys.executable, "benchmarks/engine/bench_prefix_cache.py", "--smoke", "--json", str(out)], tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    assert res["off"]["cached_prompt_tokens"] == 0 and res["off"]["requests"] == 8
    assert res["on"]["cached_prompt_tokens"] >= 8 * 96  # every request found the system prompt's 6 pages
    assert "median TTFT off / on" in r.stdout
    bad = _run(
        [sys.executable, "benchmarks/engine/bench_prefix_cache.py", "--smoke", "--clients", "0"], tmp_path
    )
    assert bad.returncode == 2 and "--clients" in bad.stderr


def test_profile_decode_step_rejects_bad_arguments(tmp_path):
    r = _run(
        [sys.executable, "benchmarks/engine/profile_decode_step.py", "--smoke", "--batch", "0"], tmp_path
    )
    assert r.returncode == 2 and "--batch" in r.stderr


def test_profile_prefill_smoke_times_both_prompts(tmp_path):
    out = tmp_path / "pp.json"
    r = _run([sys.executable, "benchmarks/engine/profile_prefill.py", "--smoke", "--lengths", "40,70",
              "--json", str(out)], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [run["length"] for run in report["runs"]] == [40, 70]
    assert all(run["ttft_first_ms"] > 0 and run["ttft_second_ms"] > 0 for run in report["runs"])


def test_profile_prefill_host_mode_times_every_stage_of_a_chunked_prompt(tmp_path):
    """--host on the CPU with the stand-in forward: a 300-token prompt in chunks of 128 runs three
    forwards; the timeline has each stage in order, the summary adds up, cProfile rows are kept."""
    out = tmp_path / "host.json"
    r = _run([sys.executable, "benchmarks/engine/profile_prefill.py", "--smoke", "--stand-in", "--host", "--profile-first",
              "--lengths", "300", "--chunk", "128", "--json", str(out)], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["stand_in"] is True
    host = report["runs"][0]["host"]
    stages = [row["stage"].split(" (")[0] for row in host["timeline"]]
    chunk = ["scheduled", "batch built", "forward start", "forward launched", "sampler launched",
             "token on host", "booked"]  # fmt: skip
    assert stages == ["start", "submitted", *chunk * 3, "returned"]
    host_ms = [row["host_ms"] for row in host["timeline"]]
    assert host_ms == sorted(host_ms) and all(row["gpu_ms"] is None for row in host["timeline"])
    s = host["summary"]
    assert s["forwards"] == 3 and s["gpu_forwards_ms"] is None  # no GPU: no events
    assert 0 < s["host_before_first_forward_ms"] < s["total_host_ms"] == host_ms[-1]
    for key in ("cprofile_tottime", "cprofile_cumtime"):
        assert 0 < len(host[key]) <= 25 and {"function", "calls", "tottime_ms", "cumtime_ms"} <= set(
            host[key][0]
        )
    cum = [row["cumtime_ms"] for row in host["cprofile_cumtime"]]
    assert cum == sorted(cum, reverse=True)
    assert any("prepare_prefill" in row["function"] for row in host["cprofile_cumtime"])
    assert "host timeline of one call (300 tokens" in r.stdout and "by tottime" in r.stdout
    first = report["runs"][0]["first_call"]  # --profile-first: the first prompt, timeline and cProfile
    assert [row["stage"].split(" (")[0] for row in first["timeline"]] == stages
    assert first["summary"]["forwards"] == 3 and first["cprofile_cumtime"][0]["cumtime_ms"] > 0


def test_profile_prefill_stand_in_needs_smoke(tmp_path):
    r = _run([sys.executable, "benchmarks/engine/profile_prefill.py", "--stand-in"], tmp_path)
    assert r.returncode == 2 and "--stand-in" in r.stderr
