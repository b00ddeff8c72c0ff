"""Running cases in Triton's interpreter. TRITON_INTERPRET=1 takes effect only if it is set before
a process first imports Triton, so each case file runs in a fresh pytest process."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_in_interpreter(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process with the interpreter on (tests/ importable too, for `helpers`)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPARSEGEN_QUIET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, cwd=TESTS.parent, timeout=timeout
    )


def assert_cases_pass(cases_file: str) -> None:
    """Run tests/<cases_file> (a path under tests/) in the interpreter; fail with its output if any
    case fails. With pytest-randomly, the cases run in an order drawn from `random`, which the
    plugin seeds from this run's --randomly-seed, so one outer seed repeats the inner order."""
    order = ["-p", "no:randomly"]
    if importlib.util.find_spec("pytest_randomly") is not None:
        order = ["-p", "randomly", f"--randomly-seed={random.randrange(2**32)}"]
    run = run_in_interpreter("-m", "pytest", "-q", "-p", "no:cacheprovider", *order, str(TESTS / cases_file))
    assert run.returncode == 0, " ".join(order) + "\n" + run.stdout[-6000:] + run.stderr[-2000:]
