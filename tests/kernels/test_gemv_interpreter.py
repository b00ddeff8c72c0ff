"""CPU tier: the batch-1 Triton GEMV and the model over it, in Triton's interpreter.

Triton's interpreter can only be switched on before a process first imports Triton, so the
cases (tests/kernels/interpreter_gemv_cases.py) run in a fresh pytest process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass


@pytest.mark.slow
def test_gemv_cases_in_interpreter():
    assert_cases_pass("kernels/interpreter_gemv_cases.py")
