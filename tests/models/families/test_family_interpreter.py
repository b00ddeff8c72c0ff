"""CPU tier: the decoder families' fused kernels (add + RMSNorm, the GEMV with RMSNorm and SwiGLU
/ GeGLU) and each family's batch-1 GEMV path, in Triton's interpreter.

Triton's interpreter can only be switched on before a process first imports Triton, so the cases
(tests/models/families/interpreter_family_cases.py) run in a fresh pytest process with
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
from helpers.interpreter import assert_cases_pass


@pytest.mark.slow
def test_family_kernels_in_interpreter():
    assert_cases_pass("models/families/interpreter_family_cases.py")
