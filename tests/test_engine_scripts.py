"""The engine's GPU scripts on a CPU: they parse their arguments, and the profile script's
`--smoke` mode runs its whole CPU path (tiny model) and writes the JSON the GPU call reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_engine_script_is_valid_bash(tmp_path):
    r = _run(["bash", "-n", "benchmarks/gpu_engine.sh"], tmp_path)
    assert r.returncode == 0, r.stderr


def test_profile_decode_step_smoke_writes_its_json(tmp_path):
    out = tmp_path / "p.json"
    r = _run([sys.executable, "benchmarks/profile_decode_step.py", "--smoke", "--batch", "2", "--steps", "1",
              "--context", "20", "--json", str(out)], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["batch"] == 2 and report["size"] == "tiny"
    assert report["CUDA graphs"]["step_ms"] > 0 and report["CUDA graphs"]["replay_ms"] is None  # no GPU
    assert report["eager_step_ms"] > 0
    assert report["aten_ops_per_step"]["aten::addmm"] >= 2 * 4  # 2 tiny layers x 4 linears, at least
    assert "aten ops per eager step" in r.stdout


def test_profile_decode_step_rejects_bad_arguments(tmp_path):
    r = _run([sys.executable, "benchmarks/profile_decode_step.py", "--smoke", "--batch", "0"], tmp_path)
    assert r.returncode == 2 and "--batch" in r.stderr


def test_profile_prefill_smoke_times_both_prompts(tmp_path):
    out = tmp_path / "pp.json"
    r = _run([sys.executable, "benchmarks/profile_prefill.py", "--smoke", "--lengths", "40,70",
              "--json", str(out)], tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [run["length"] for run in report["runs"]] == [40, 70]
    assert all(run["ttft_first_ms"] > 0 and run["ttft_second_ms"] > 0 for run in report["runs"])
