"""How a failure leaves the command line (DESIGN §3): its exit status and its one line.

A sparsegen error that is a `ValueError` means the input was wrong: a usage error, exit 2. Any
other is a runtime failure, exit 1. Either prints one line, the first of the error's message.
`cli.py` applies this to every command; a command that catches an error itself uses it too.
"""

from __future__ import annotations

import click

from ..errors import SparsegenError


class RuntimeFailure(click.ClickException):
    """A runtime failure: exit status 1 with one line."""

    exit_code = 1


def is_usage_error(exc: SparsegenError) -> bool:
    """sparsegen's ValueError kinds mean the input was wrong (exit 2); the rest are runtime (exit 1)."""
    return isinstance(exc, ValueError)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
