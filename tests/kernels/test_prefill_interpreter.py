"""CPU tier: the generated prefill kernels in Triton's interpreter (cases in interpreter_prefill_cases.py).

Triton decorates its own library functions when it is imported, so the interpreter can only be
switched on before the first `import triton` of a process. The cases therefore run in a fresh
pytest process with TRITON_INTERPRET=1, whatever this session imported before.
"""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass, run_in_interpreter


@pytest.mark.slow
def test_generated_kernels_match_reference_in_interpreter():
    assert_cases_pass("kernels/interpreter_prefill_cases.py")


@pytest.mark.slow
def test_fuzz_command_on_cpu():
    run = run_in_interpreter(
        "-m", "sparsegen.cli", "fuzz", "--random", "--examples", "3", "--max-len", "80", "--seed", "1"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "prefill: 36 cases over 12 spec(s), 0 failed" in run.stdout
    assert "decode: not run (the CUDA kernel needs a GPU)" in run.stdout
    assert run.stderr == ""  # SPARSEGEN_QUIET=1: errors only


def test_fuzz_command_reports_a_wrong_kernel(monkeypatch):
    """The fuzz check can fail: a kernel that is off by a little (a test double: the reference
    times 1.05) is caught and named; each spec stops at its first failure and reports it shrunk."""
    from click.testing import CliRunner

    from sparsegen import ops, reference
    from sparsegen.cli import cli

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "0")
    monkeypatch.setattr(ops, "prefill", lambda *args, impl=None: reference.prefill(*args) * 1.05)
    args = ["fuzz", "--random", "--specs", "2", "--examples", "2", "--max-len", "40", "--seed", "3"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert result.output.count("FAIL prefill (") == 2
    assert result.output.count("minimal failing example (prefill, spec ") == 2
    assert "rows over the per-row tolerance" in result.output
    assert "prefill: 2 cases over 2 spec(s), 2 failed" in result.output
