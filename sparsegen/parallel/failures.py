"""What crosses the process boundary when a tensor-parallel rank fails, and how the driver raises it.

A rank's exception travels as a picklable `Failure` (its class by module and name, message,
traceback); the driver raises the rank's own sparsegen error type when it has one, else a
`DistributedError` naming the rank.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

from ..errors import DistributedError, InputError, SparsegenError


@dataclass(frozen=True)
class Failure:
    module: str
    name: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Refused:
    """A request every rank refused alike, or a result that cannot be sent back: every rank
    goes on, and the driver raises the error."""

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
