"""CPU tier: the tl prefill kernel on narrow windows (packed GQA heads, narrow key tiles) in
Triton's interpreter (cases in interpreter_prefill_narrow_cases.py, run in a fresh process)."""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass


@pytest.mark.slow
def test_narrow_window_kernels_match_reference_in_interpreter():
    assert_cases_pass("kernels/interpreter_prefill_narrow_cases.py")
