"""CPU tier: the fused rotary + KV-write kernel over an fp8 cache, in Triton's interpreter (a
fresh process: tests/models/interpreter_rotary_fp8_cases.py)."""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass


@pytest.mark.slow
def test_fused_rotary_fp8_write_in_interpreter():
    assert_cases_pass("models/interpreter_rotary_fp8_cases.py")
