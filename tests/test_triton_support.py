"""The tested Triton releases, the requirement in pyproject.toml and what `sparsegen env` says
about the installed Triton agree."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from sparsegen.jit import triton_support

ROOT = Path(__file__).resolve().parents[1]


def _requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (triton,) = [Requirement(d) for d in deps if Requirement(d).name == "triton"]
    return triton


def test_requirement_admits_exactly_the_tested_minor_series():
    req = _requirement()
    assert req.specifier == Requirement(triton_support.REQUIREMENT).specifier
    admitted = {(3, m) for m in range(30) for patch in (0, 1, 99) if req.specifier.contains(f"3.{m}.{patch}")}
    assert admitted == {triton_support.release(v)[:2] for v in triton_support.TESTED}
    assert all(req.specifier.contains(v) for v in triton_support.TESTED)
    assert not req.specifier.contains("4.0.0") and not req.specifier.contains("3.10.0")


def test_tested_and_range():
    assert triton_support.release("3.9.0+git1a2b") == (3, 9, 0) and triton_support.release("v3.10") == (3, 10)
    assert (
        triton_support.tested("3.9.0") and triton_support.tested("3.6") and triton_support.tested("3.7.1+cu")
    )
    assert not triton_support.tested("3.7.0") and not triton_support.tested("3.10.0")
    assert triton_support.in_range("3.7.0") and triton_support.in_range("3.9.5")
    assert not triton_support.in_range("3.5.1") and not triton_support.in_range("3.10.0")


def test_warning_sentences():
    assert triton_support.warning("3.8.0") is None
    assert "outside the tested range 3.6.0 - 3.9.0" in triton_support.warning("3.10.0")
    assert "not itself tested" in triton_support.warning("3.7.0")
    assert "not installed" in triton_support.warning(None)
