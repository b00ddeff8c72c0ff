"""The default sm_90 prefill falls back to the tl kernel when the Gluon kernel does not build on an
untested Triton (one warning naming the version and the cause); a tested Triton, or an explicit
`variant="gluon"`, gets the CompileError, whose first line is the compiler's own message."""

from __future__ import annotations

import logging

import pytest
import torch

import sparsegen
from sparsegen import CompileError, LayerSpec
from sparsegen.jit import triton_support
from sparsegen.kernels import gluon_api

pytestmark = pytest.mark.skipif(
    gluon_api.available() is not None, reason=f"no Gluon: {gluon_api.available()}"
)

CAUSE = "no_such_op is not defined (at 3:4 of _producer: no_such_op(x))"
FAILURE = f"Triton failed to compile the Gluon kernel prefill_kernel for sm_90: {CAUSE}\n\nat 3:4:\n..."


@pytest.fixture
def broken_gluon(monkeypatch, fresh_cache):
    """Every Gluon build fails as Triton would report it; returns the requests it was asked for."""
    from sparsegen.kernels.prefill_gluon import GluonPrefill

    tried = []

    def build(self, request, source, module_name):
        tried.append(request)
        raise CompileError(FAILURE)

    monkeypatch.setattr(GluonPrefill, "build", build)
    monkeypatch.delenv("SPARSEGEN_PREFILL_TL", raising=False)
    return tried


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_untested_triton_falls_back_to_tl_with_one_warning(broken_gluon, monkeypatch, caplog):
    monkeypatch.setattr(triton_support, "installed", lambda: "3.10.0")
    sparse, dense = sparsegen.get_pattern("phi3small").layers[:2]
    assert sparse != dense
    twin = LayerSpec.from_json(sparse.to_json())  # equal to `sparse`, another object
    with caplog.at_level(logging.WARNING, logger="sparsegen"):
        kernels = [sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90")
                   for layer in (sparse, dense, twin)]  # fmt: skip
    assert [k.request.variant for k in kernels] == ["tl", "tl", "tl"]
    assert kernels[2] is kernels[0] and not kernels[0].name.startswith("prefill_gluon")
    assert [r.layer for r in broken_gluon] == [sparse, dense], "a failed Gluon build was retried"
    (warning,) = _warnings(caplog)
    assert "Triton 3.10.0" in warning and CAUSE in warning and "tl kernel" in warning, warning


def test_tested_triton_raises_the_build_error(broken_gluon, monkeypatch, caplog):
    monkeypatch.setattr(triton_support, "installed", lambda: triton_support.TESTED[-1])
    layer = sparsegen.get_pattern("phi3small").layers[0]
    with (
        caplog.at_level(logging.WARNING, logger="sparsegen"),
        pytest.raises(CompileError, match="no_such_op"),
    ):
        sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90")
    assert _warnings(caplog) == []


def test_explicit_gluon_never_falls_back(broken_gluon, monkeypatch, caplog):
    monkeypatch.setattr(triton_support, "installed", lambda: "3.10.0")
    layer = sparsegen.get_pattern("phi3small").layers[0]
    with caplog.at_level(logging.WARNING, logger="sparsegen"), pytest.raises(CompileError) as info:
        sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90", variant="gluon")
    assert str(info.value).splitlines()[0].endswith(CAUSE)
    assert _warnings(caplog) == [] and len(broken_gluon) == 1


def test_a_real_gluon_failure_names_the_compilers_message(fresh_cache, monkeypatch, tmp_path):
    """A Gluon builtin that raises (as Triton 3.9's removed `async_copy_global_to_shared` does):
    the error's first line is its message and the @jit function and source line it came from,
    not the bare location of the outermost frame ("at 18:4:")."""
    from triton.language.core import builtin

    @builtin
    def removed(*args, _semantic=None, **kwargs):
        raise RuntimeError("tma_load has been removed; call tma_fetch instead")

    monkeypatch.setattr(gluon_api, "tma_load", removed)  # the rendered module imports it from here
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # Triton's own cache would hide it
    layer = sparsegen.get_pattern("phi3small").layers[1]
    with pytest.raises(CompileError) as info:
        sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90", variant="gluon")
    first = str(info.value).splitlines()[0]
    assert first.startswith(
        "Triton failed to compile the kernel prefill_kernel (through sparsegen.kernels.gluon_api:GluonASTSource) for sm_90: "
    )
    assert (
        "tma_load has been removed; call tma_fetch instead (at " in first
        and "of _producer: tma_load(" in first
    )


def test_a_triton_without_gluon_gets_tl_and_one_warning(monkeypatch, caplog):
    from sparsegen.kernels import base, gluon_fallback

    monkeypatch.setattr(gluon_api, "available", lambda: "ImportError: no module gluon")
    monkeypatch.delenv("SPARSEGEN_PREFILL_TL", raising=False)
    gluon_fallback.forget()
    layer = sparsegen.get_pattern("phi3small").layers[0]
    with caplog.at_level(logging.WARNING, logger="sparsegen"):
        assert [base.default_variant("prefill", "sm_90", layer, "bf16") for _ in range(3)] == ["tl"] * 3
    (warning,) = _warnings(caplog)
    assert "no usable Gluon (ImportError: no module gluon)" in warning and "tl kernel" in warning
    gluon_fallback.forget()
