"""CompileError messages lead with the compiler's own line: Triton's innermost message (with the
@jit function and source line it points at), NVRTC's first error line."""

from __future__ import annotations

import importlib.util

import pytest

from sparsegen import CompileError
from sparsegen.jit import compile_errors, triton_build

BAD_TL = """import triton
import triton.language as tl


@triton.jit
def inner(X):
    return tl.load(X + tl.arange(0, 7))


@triton.jit
def kernel(X):
    tl.store(X, inner(X))
"""


def test_triton_error_leads_with_the_innermost_message(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    job = {"source": BAD_TL, "fn_name": "kernel", "signature": {"X": "*fp32"}, "aligned": [], "arch": "sm_80",
           "options": {"num_warps": 4}, "module_name": "sparsegen_test_bad_tl", "source_file": "bad.py",
           "gluon": False}  # fmt: skip
    with pytest.raises(CompileError) as info:
        triton_build.compile_in_process(job)
    first, *rest = str(info.value).splitlines()
    assert first.startswith("Triton failed to compile the kernel kernel for sm_80: ")
    assert "arange's range must be a power of 2 (at " in first and " of inner: return tl.load(" in first
    assert "^" in [line.strip() for line in rest]  # the located excerpt follows


class _Located(Exception):
    """Shaped like Triton's CompilationError: a location, the source, a caret, maybe a message."""

    def __init__(self, text: str, src: str, error_message=None):
        super().__init__(text)
        self.src, self.error_message = src, error_message


def _raise_chain() -> BaseException:
    try:
        try:
            try:
                raise RuntimeError("the real cause\n")
            except RuntimeError as exc:
                raise _Located(
                    "at 2:8:\n    y = f(x)\n        ^\nthe real cause", "def leaf(x):\n", "the real cause"
                ) from exc
        except _Located as exc:
            raise _Located("at 9:4:\n    g(a)\n    ^", "@jit\ndef top(a):\n") from exc
    except _Located as exc:
        return exc


def test_cause_skips_locations_carets_and_source():
    exc = _raise_chain()
    assert compile_errors.triton_cause(exc) == "the real cause (at 2:8 of leaf: y = f(x))"
    assert compile_errors.triton_context(exc).startswith("at 2:8:")
    assert compile_errors.triton_cause(ValueError("plain\n\nlast line")) == "last line"
    assert compile_errors.triton_cause(KeyError()) == "KeyError"


NVRTC_LOG = """6: NVRTC_ERROR_COMPILATION, compilation log:

k(1): error: identifier "y" is undefined
  extern "C" __global__ void k(float* x){ x[0] = y; }
                                                 ^

k(1): error: a value of type "const char *" cannot be used to initialize an entity of type "int"

2 errors detected in the compilation of "k".
\x00
"""


def test_nvrtc_cause_is_the_first_error_line():
    assert compile_errors.nvrtc_cause(NVRTC_LOG) == 'k(1): error: identifier "y" is undefined'
    warned = 'k(1): warning #177-D: variable "u" was declared but never referenced\n\nRemark: ...'
    assert compile_errors.nvrtc_cause(warned, "warning").startswith("k(1): warning #177-D")
    assert compile_errors.nvrtc_cause("") == "no compiler output"


@pytest.mark.skipif(importlib.util.find_spec("cuda.core") is None, reason="needs the cuda extra (cuda-core)")
def test_nvrtc_error_message_leads_with_the_error_line():
    from sparsegen.jit import nvrtc_build

    with pytest.raises(CompileError) as info:
        nvrtc_build.compile_cubin(
            'extern "C" __global__ void k(float* x) { x[0] = y; }', "sm_90", name="broken"
        )
    first = str(info.value).splitlines()[0]
    assert first == 'NVRTC failed to compile broken for sm_90: broken(1): error: identifier "y" is undefined'
    assert "\x00" not in str(info.value)


DOT = """import triton
import triton.language as tl


@triton.jit
def kernel(X):
    offs = tl.arange(0, 128)
    a = tl.load(X + offs[:, None] * 128 + offs[None, :])
    tl.store(X + offs[:, None] * 128 + offs[None, :], tl.dot(a, a))
"""


@pytest.mark.parametrize(
    "options, cause",
    [
        # ptxas refuses 3 registers: its "fatal" line, not the CalledProcessError below it
        ({"num_warps": 4, "maxnreg": 3}, "ptxas: (C7602) Insufficient registers"),
        # an MLIR pass fails: its diagnostics go to fd 2, the exception says "PassManager::run failed"
        ({"num_warps": 4, "num_ctas": 3}, "dot.py:"),
    ],
)
def test_toolchain_failures_name_their_own_error_line(tmp_path, monkeypatch, capfd, options, cause):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    job = {"source": DOT, "fn_name": "kernel", "signature": {"X": "*fp16"}, "aligned": [], "arch": "sm_90",
           "options": options, "module_name": "sparsegen_test_dot", "source_file": "dot.py", "gluon": False}  # fmt: skip
    with pytest.raises(CompileError) as info:
        triton_build.compile_in_process(job)
    first = str(info.value).splitlines()[0]
    assert first.startswith("Triton failed to compile the kernel kernel for sm_90: " + cause), first
    assert "PassManager::run failed" not in first and "exit status" not in first
    if "num_ctas" in options:
        assert ": error: " in first and "ConvertTritonToTritonGPU" in first  # the failing pass
        assert "error: Failures have been detected" in capfd.readouterr().err  # replayed, not swallowed


def test_mlir_cause_prefers_a_specific_error():
    diagnostics = (
        "/tmp/x/kernel.py:7:12: error: 'ttg.convert_layout' op layouts differ\n"
        "/tmp/x/kernel.py:4:0: error: Failures have been detected while processing an MLIR pass pipeline\n"
        "/tmp/x/kernel.py:4:0: note: Pipeline failed while executing [`TritonGPUCoalesce` on 'builtin.module']: ...\n"
    )
    assert (
        compile_errors.mlir_cause(diagnostics)
        == "kernel.py:7:12: error: 'ttg.convert_layout' op layouts differ"
    )
    assert compile_errors.mlir_cause("nothing here") is None
