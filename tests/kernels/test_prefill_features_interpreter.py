"""CPU tier: the tl prefill kernel's attention features in Triton's interpreter
(cases in interpreter_prefill_feature_cases.py, run in a fresh process)."""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass


@pytest.mark.slow
def test_feature_kernels_match_reference_in_interpreter():
    assert_cases_pass("kernels/interpreter_prefill_feature_cases.py")
