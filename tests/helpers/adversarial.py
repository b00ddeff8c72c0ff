"""Helpers for the adversarial suites: each case must end in a typed error or a checked value.

`refused(...)` passes only for a `SparsegenError` of the expected class whose message matches;
any other exception fails the test as a crash. `accepted(...)` passes only when the call
returns and `check(result)` holds. With SPARSEGEN_ADV_TALLY=FILE set, every case appends one
line (`typed`, `value`, `crash` or `wrong`) to FILE, which is how the report's counts are made.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest

from sparsegen.errors import SparsegenError


def _tally(kind: str, what: str) -> None:
    path = os.environ.get("SPARSEGEN_ADV_TALLY")
    if path:
        with open(path, "a") as f:
            f.write(f"{kind}\t{what[:120]!r}\n")


def refused(
    error: type[SparsegenError], match: str, fn: Callable[..., Any], *args, **kwargs
) -> SparsegenError:
    """fn(*args, **kwargs) raises `error` (a SparsegenError) whose message matches `match`."""
    what = f"{getattr(fn, '__name__', fn)}{args!r:.60}{kwargs!r:.40}"
    try:
        result = fn(*args, **kwargs)
    except error as exc:
        if not re.search(match, str(exc)):
            _tally("wrong", what)
            pytest.fail(f"{what}: message {str(exc)!r} does not match {match!r}")
        if "\n" in str(exc).strip() and "Traceback" in str(exc):
            _tally("wrong", what)
            pytest.fail(f"{what}: message carries a traceback: {exc}")
        _tally("typed", what)
        return exc
    except SparsegenError as exc:
        _tally("wrong", what)
        pytest.fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {error.__name__}")
    except Exception as exc:  # noqa: BLE001 - an untyped exception is what this suite hunts
        _tally("crash", what)
        pytest.fail(f"{what}: crashed with {type(exc).__name__}: {exc}")
    _tally("wrong", what)
    pytest.fail(f"{what}: accepted (returned {result!r:.80}), expected {error.__name__} matching {match!r}")


def accepted(check: Callable[[Any], bool], fn: Callable[..., Any], *args, **kwargs) -> Any:
    """fn(*args, **kwargs) returns a result for which check(result) is true."""
    what = f"{getattr(fn, '__name__', fn)}{args!r:.60}{kwargs!r:.40}"
    try:
        result = fn(*args, **kwargs)
    except SparsegenError as exc:
        _tally("wrong", what)
        pytest.fail(f"{what}: refused a valid input: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        _tally("crash", what)
        pytest.fail(f"{what}: crashed with {type(exc).__name__}: {exc}")
    if not check(result):
        _tally("wrong", what)
        pytest.fail(f"{what}: wrong result {result!r:.200}")
    _tally("value", what)
    return result


def either(
    error: type[SparsegenError], check: Callable[[Any], bool], fn: Callable[..., Any], *args, **kwargs
):
    """For fuzzed inputs that may be valid: a typed `error`, or a result for which check holds."""
    what = f"{getattr(fn, '__name__', fn)}{args!r:.60}{kwargs!r:.40}"
    try:
        result = fn(*args, **kwargs)
    except error as exc:
        _tally("typed", what)
        return exc
    except Exception as exc:  # noqa: BLE001
        _tally("crash", what)
        pytest.fail(f"{what}: crashed with {type(exc).__name__}: {exc}")
    if not check(result):
        _tally("wrong", what)
        pytest.fail(f"{what}: wrong result {result!r:.200}")
    _tally("value", what)
    return result
