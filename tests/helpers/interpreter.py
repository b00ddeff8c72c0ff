"""Running cases in Triton's interpreter. TRITON_INTERPRET=1 takes effect only if it is set before
a process first imports Triton, so each case file runs in a fresh pytest process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_in_interpreter(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process with the interpreter on (tests/ importable too)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPARSEGEN_QUIET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, cwd=HERE.parent, timeout=timeout
    )


def assert_cases_pass(cases_file: str) -> None:
    """Run tests/<cases_file> in the interpreter; fail with its output if any case fails."""
    run = run_in_interpreter("-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / cases_file))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.fixture
def interpreter_env(monkeypatch):
    """For the case files themselves: the interpreter flag (and quiet logs) for every case."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")
