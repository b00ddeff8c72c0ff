"""CPU tier: the batch-1 Triton GEMV and the model over it, in Triton's interpreter.

Triton's interpreter can only be switched on before a process first imports Triton, so the
cases (tests/interpreter_gemv_cases.py) run in a fresh pytest process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_gemv_cases_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPARSEGEN_QUIET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    cases = str(HERE / "interpreter_gemv_cases.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases],
        env=env, capture_output=True, text=True, cwd=HERE.parent, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
