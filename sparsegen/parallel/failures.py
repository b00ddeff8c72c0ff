"""What crosses the process boundary when a tensor-parallel rank fails, and how the driver raises it.

A rank's exception travels as a picklable `Failure` (its class by module and name, message,
traceback); the driver raises the rank's own sparsegen error type when it has one, else a
`DistributedError` naming the rank. After a first failure the driver gathers the other ranks'
reports for `GRACE_S` (`collect_reports`) and raises the cause (`failure_error`): a rank's own
exception rather than a peer's broken collective, else the ranks that were lost.
"""

from __future__ import annotations

import importlib
import queue
import time
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

from ..errors import DistributedError, InputError, SparsegenError
from ..log import get_logger

log = get_logger(__name__)

GRACE_S = 1.0  # after a first failure, how long to collect the other ranks' reports
# errors of the request or the input, the same on every rank: no traceback in the log
USER_ERRORS = ("InputError", "CheckpointError", "TokenizerError", "CacheOutOfMemory")


@dataclass(frozen=True)
class Failure:
    """One rank's exception, as text."""

    module: str
    name: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Refused:
    """A result that cannot be sent back: every rank goes on, and the driver raises the error."""

    failure: Failure


def describe(exc: BaseException) -> Failure:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Failure(type(exc).__module__, type(exc).__qualname__, str(exc), tb)


def check_pickles(obj, what: str) -> None:
    """A multiprocessing queue pickles in a feeder thread and drops what fails there, which
    would leave the other side waiting: check here instead."""
    try:
        ForkingPickler.dumps(obj)
    except Exception as exc:
        raise InputError(f"{what} cannot be sent between tensor-parallel processes: {exc}") from None


def exit_text(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def reraise(rank: int, f: Failure, others: str) -> BaseException:
    """The rank's own error type when it is one of sparsegen's (the same on every rank: a bad
    checkpoint, a bad request), else a DistributedError naming the rank."""
    try:
        cls = getattr(importlib.import_module(f.module), f.name)
    except Exception:
        cls = None
    if isinstance(cls, type) and issubclass(cls, SparsegenError) and cls is not DistributedError:
        try:
            return cls(f.message + others)
        except Exception:
            pass
    first = f.message.strip().splitlines()[0] if f.message.strip() else ""
    if f.name == "DistributedError":
        return DistributedError(first + others)
    return DistributedError(f"tensor-parallel rank {rank} failed: {f.name}: {first}{others}")


def collect_reports(out, errors: dict[int, Failure], dead: dict[int, int], procs) -> None:
    """Add to `errors` the reports that reach `out` within GRACE_S (or until every rank has
    failed), then to `dead` the exit codes of the ranks that are gone without a report."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and len(errors) + len(dead) < len(procs):
        try:
            kind, rank, value = out.get(timeout=0.05)
            if kind == "error":
                errors.setdefault(rank, value)
        except queue.Empty:
            pass
    for r, p in enumerate(procs):
        if r not in errors and p.exitcode is not None:
            dead.setdefault(r, p.exitcode)


def failure_error(errors: dict[int, Failure], dead: dict[int, int]) -> BaseException:
    """The one error the driver raises for the ranks' reports and exit codes."""
    lost = [f"rank {r} {exit_text(c)}" for r, c in sorted(dead.items()) if r not in errors]
    causes = [r for r, f in sorted(errors.items()) if f.name != "DistributedError"]
    if causes:
        r = causes[0]
        if errors[r].name not in USER_ERRORS:
            log.error("tensor-parallel rank %d failed:\n%s", r, errors[r].traceback.rstrip())
        others = f" (also: {'; '.join(lost)})" if lost else ""
        return reraise(r, errors[r], others)
    if lost:
        seen = f"; rank {min(errors)} saw: {errors[min(errors)].message.splitlines()[0]}" if errors else ""
        return DistributedError(f"tensor-parallel {', '.join(lost)}; the other ranks were stopped{seen}")
    r = min(errors)
    return reraise(r, errors[r], "")
