"""CPU tier: the model and engine over the generated Triton prefill kernel, in the interpreter.

Triton's interpreter can only be switched on before a process first imports Triton, so the
cases (tests/models/interpreter_model_cases.py) run in a fresh pytest process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass


@pytest.mark.slow
def test_model_over_generated_prefill_kernel_in_interpreter():
    assert_cases_pass("models/interpreter_model_cases.py")
