"""CPU tier: the generated prefill kernels in Triton's interpreter (cases in interpreter_prefill_cases.py).

Triton decorates its own library functions when it is imported, so the interpreter can only be
switched on before the first `import triton` of a process. The cases therefore run in a fresh
pytest process with TRITON_INTERPRET=1, whatever this session imported before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _run_in_interpreter(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "SPARSEGEN_QUIET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, cwd=HERE.parent, timeout=900
    )


def test_generated_kernels_match_reference_in_interpreter():
    cases = str(HERE / "interpreter_prefill_cases.py")
    run = _run_in_interpreter("-m", "pytest", "-q", "-p", "no:cacheprovider", cases)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_fuzz_command_on_cpu():
    run = _run_in_interpreter(
        "-m", "sparsegen.cli", "fuzz", "--random", "--examples", "3", "--max-len", "80", "--seed", "1"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "3 cases, 0 failed" in run.stderr
