"""Optional extras the tests use, under one rule: where an extra does not import, its tests skip
on a developer's machine but fail where every extra must be there.

CI installs every extra (.ci/install) and runs with CI set, so there a missing or broken extra
is a failure that names the extra, not a few hundred quiet skips. SPARSEGEN_REQUIRE_EXTRAS=1 asks
for the same anywhere. Called at module level, a skip skips the module and a failure is a
collection error; called inside a test, they skip or fail that test. GPU skips are not extras
and stay skips.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

# The extra (pyproject.toml's optional-dependencies) that brings each module the tests import.
EXTRA_OF = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "openai": "test",
    "httpx": "test",
    "lm_eval": "test",
    "cuda.core": "cuda",
    "cuda.bindings.nvrtc": "cuda",
    "matplotlib": "plot",
    "transformers": "hf",
    "tokenizers": "model",
    "llguidance": "structured",
    "jsonschema": "test",
}


def extras_required() -> bool:
    """True under CI (CI set and not "0"/"false") or with SPARSEGEN_REQUIRE_EXTRAS=1."""
    ci = os.environ.get("CI", "").strip().lower()
    return ci not in ("", "0", "false") or os.environ.get("SPARSEGEN_REQUIRE_EXTRAS") == "1"


def missing(what: str, why: str) -> None:
    """Skip (or, where extras are required, fail) because `what` is not usable: `why`."""
    reason = f"{what} is not usable here: {why}"
    if extras_required():
        pytest.fail(
            f"{reason} (CI or SPARSEGEN_REQUIRE_EXTRAS=1: every extra must import; "
            "install it with `pip install -e '.[test,cuda,plot,serve]'`)",
            pytrace=False,
        )
    pytest.skip(reason, allow_module_level=True)


def require(module: str) -> ModuleType:
    """Import and return `module`, one of EXTRA_OF's; skip or fail naming its extra if it does not
    import."""
    extra = EXTRA_OF[module]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{module} (the [{extra}] extra)", f"{type(exc).__name__}: {exc}")
        raise  # not reached: missing() raises


def require_gluon() -> None:
    """Triton's Gluon, with every name the Hopper prefill uses (the core's triton brings it)."""
    from sparsegen.kernels import gluon_api

    reason = gluon_api.available()
    if reason is not None:
        missing("Gluon (triton.experimental.gluon)", reason)


def require_nvrtc() -> None:
    """NVRTC and the CUDA headers through cuda-core (the [cuda] extra), enough to compile."""
    from sparsegen.jit import nvrtc_build

    try:
        nvrtc_build.cuda_include_dir()
        nvrtc_build._core()
    except Exception as exc:  # noqa: BLE001 - whatever the missing piece raises
        missing("NVRTC (the [cuda] extra)", f"{type(exc).__name__}: {exc}")
