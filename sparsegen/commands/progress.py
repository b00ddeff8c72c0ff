"""Progress bars (tqdm) for the CLI's long jobs: compile, fuzz, generate, bench.

A bar is drawn only on an interactive stderr, never with --json, and never when sparsegen's
log level hides INFO (SPARSEGEN_QUIET=1). Otherwise `bar()` hands back a stand-in with the same
methods that draws nothing, so callers never branch. Updates take a lock: compile's builds
finish in several threads at once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

import click

from ..log import enabled as log_enabled


def bars_wanted(*, as_json: bool = False, stream=None) -> bool:
    """Whether a bar may be drawn on `stream` (default: the current sys.stderr)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not as_json and bool(isatty and isatty()) and log_enabled(logging.INFO)


class Progress:
    """A thread-safe handle on one tqdm bar, or on nothing when bars are off."""

    def __init__(self, total: int | None, desc: str, unit: str, draw: bool):
        self._lock = threading.Lock()
        self._bar = None
        if draw:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True
            )

    @property
    def drawn(self) -> bool:
        return self._bar is not None

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        if self._bar is None:
            return
        with self._lock:
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n)

    def note(self, postfix: str) -> None:
        """Show `postfix` (e.g. the kernel now building) next to the bar without advancing it."""
        if self._bar is None:
            return
        with self._lock:
            self._bar.set_postfix_str(postfix)

    def echo(self, line: str) -> None:
        """Print a line of data on stdout; above the bar (cleared and redrawn) while one is drawn."""
        if self._bar is None:
            click.echo(line)
            return
        with self._lock:
            self._bar.write(line, file=sys.stdout)

    def close(self) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def quiet_cache_log():
    """Leave out the kernel cache's INFO lines ("compiling X ...", "compiled X in ...") for a
    job that reports its kernels itself (compile's line per kernel, fuzz's bar); warnings stay."""
    cache_log = logging.getLogger("sparsegen.jit.cache")
    before = cache_log.level
    cache_log.setLevel(max(logging.WARNING, before))
    try:
        yield
    finally:
        cache_log.setLevel(before)


def bar(total: int | None, desc: str, unit: str = "it", *, as_json: bool = False) -> Progress:
    """A bar over `total` steps (None: unknown), drawn only where `bars_wanted` says so."""
    return Progress(total, desc, unit, bars_wanted(as_json=as_json))
