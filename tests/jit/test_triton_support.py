"""The tested Triton releases, the requirement in pyproject.toml and what `sparsegen env` says
about the installed Triton agree."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from sparsegen.jit import triton_support

ROOT = Path(__file__).resolve().parents[2]


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
    # every published release in the range is built by CI: 3.7.0 (before 3.7.1) is not, so it is excluded
    assert not req.specifier.contains("3.7.0")


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


def test_env_lists_every_extras_packages_as_pyproject_declares_them():
    from sparsegen.commands.env import EXTRAS, PACKAGES

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {"core": project["dependencies"], **project["optional-dependencies"]}
    for extra, reqs in declared.items():
        names = [Requirement(r).name for r in reqs if Requirement(r).name != "sparsegen"]
        if not names:  # an extra made only of other extras (cuda = sparsegen[cu13])
            assert extra not in EXTRAS
            continue
        assert list(EXTRAS[extra]) == names, extra
    assert set(EXTRAS) <= set(declared) and set(PACKAGES) >= {n for d in EXTRAS.values() for n in d}


def test_env_shows_torch_cuda_and_warns_for_an_untested_triton(monkeypatch):
    import json

    from click.testing import CliRunner

    from sparsegen.cli import cli
    from sparsegen.commands import env as env_cmd

    res = CliRunner().invoke(cli, ["env", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["torch_cuda"] == __import__("torch").version.cuda
    assert report["triton_warning"] == triton_support.warning(report["packages"]["triton"])
    real = env_cmd._version
    monkeypatch.setattr(env_cmd, "_version", lambda name: "3.10.0" if name == "triton" else real(name))
    text = CliRunner().invoke(cli, ["env"]).stdout
    assert "warning: Triton 3.10.0 is outside the tested range" in text
    assert "CPU-only build" in text or "built for CUDA" in text
    assert "  [serve]" in text and "prometheus-client" in text
