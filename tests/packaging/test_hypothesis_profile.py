"""CI's hypothesis profile draws fresh examples each run, from a seed the run prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import core, settings

TESTS = Path(__file__).resolve().parents[1]


def test_ci_profile_is_random_bounded_and_without_deadline():
    ci = settings.get_profile("ci")
    assert not ci.derandomize
    assert ci.deadline is None
    assert ci.max_examples <= 25  # the CPU tier's time stays where it was
    assert settings.get_profile("ci-derandomized").derandomize


def test_this_run_has_a_seed():
    if not settings.default.derandomize:
        assert isinstance(core.global_force_seed, int)


@pytest.mark.slow  # three pytest processes, each importing torch
def test_ci_run_prints_a_fresh_seed_that_repeats_it(tmp_path):
    def run(*extra: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
             str(TESTS / "packaging" / "test_hypothesis_profile.py::test_ci_profile_is_random_bounded_and_without_deadline"),
             *extra],
            capture_output=True, text=True, env={**os.environ, "CI": "true",
                                                  "HYPOTHESIS_PROFILE": "ci"},
            cwd=TESTS.parent, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        lines = [
            x for x in out.stdout.splitlines() if x.startswith("hypothesis examples: --hypothesis-seed=")
        ]
        assert len(lines) == 1, out.stdout[-2000:]
        return lines[0].split("=")[1].split()[0]

    first, second = run(), run()
    assert first != second  # fresh each run (2**32 seeds: a collision is a 1 in 4e9 event)
    assert run(f"--hypothesis-seed={first}") == first
