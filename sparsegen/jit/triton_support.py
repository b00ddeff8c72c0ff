"""The Triton releases sparsegen is tested on, and what to say about the one installed.

    triton_support.TESTED                 # the releases CI builds every phi3small kernel with
    triton_support.tested("3.9.0")        # True: one of them
    triton_support.warning("3.10.0")      # a sentence for `sparsegen env`, or None when tested

`TESTED` is the one list: `.ci/triton_matrix.py` builds with each release in it (a venv per
release), the requirement in pyproject.toml admits exactly their minor series (a test holds the
two together), and the Gluon prefill falls back to the tl kernel only on a Triton not in it.
"""

from __future__ import annotations

import re

TESTED = ("3.6.0", "3.7.1", "3.8.0", "3.9.0")  # oldest first
REQUIREMENT = (
    "triton>=3.6,!=3.7.0,<3.10"  # pyproject.toml's (kept equal by a test); 3.7.0 is published but untested
)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '3.9.0+git1a2b' -> (3, 9, 0), '3.10' -> (3, 10)."""
    found = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in found.group(1).split(".")) if found else ()


def _padded(version: str) -> tuple[int, ...]:
    return (release(version) + (0, 0, 0))[:3]


def tested(version: str) -> bool:
    """Whether `version` is one of the releases CI builds with (local suffixes ignored)."""
    return _padded(version) in {_padded(t) for t in TESTED}


def in_range(version: str) -> bool:
    """Whether `version` lies in the tested range (from the oldest to the newest tested minor)."""
    first, last = _padded(TESTED[0]), _padded(TESTED[-1])
    return first <= _padded(version) and _padded(version)[:2] <= last[:2]


def installed() -> str | None:
    """The installed Triton's version, or None without Triton (read without importing it)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def warning(version: str | None) -> str | None:
    """What a user should know about running with Triton `version`; None for a tested release."""
    if version is None:
        return f"Triton is not installed; sparsegen needs {REQUIREMENT}"
    if tested(version):
        return None
    listed = ", ".join(TESTED)
    if not in_range(version):
        return (
            f"Triton {version} is outside the tested range {TESTED[0]} - {TESTED[-1]} ({REQUIREMENT}); "
            "a Gluon prefill that fails to build falls back to the tl kernel"
        )
    return (
        f"Triton {version} is in the tested range but not itself tested (tested: {listed}); "
        "a Gluon prefill that fails to build falls back to the tl kernel"
    )
