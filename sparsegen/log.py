"""sparsegen's messages: one `logging` tree under the "sparsegen" logger, never `print`.

Modules log through `get_logger(__name__)`. The level comes from the environment:
`SPARSEGEN_QUIET=1` keeps only errors; otherwise `SPARSEGEN_LOG_LEVEL` (`debug`, `info`,
`warning`, `error`, `critical`) and `INFO` by default, so a cold kernel build says what it
compiles and how long it took. Both are read through `sparsegen.env` (EnvError on a bad value).

Where the messages go:
- the CLI calls `install_cli_handler()`: one stderr handler that writes through tqdm, so a
  message printed while a progress bar is drawn lands above the bar instead of inside it;
- a library user who has configured logging (the root logger has a handler) gets the
  messages through their own handlers (records always propagate to the root logger);
- otherwise the first `get_logger()` adds the same stderr handler, so a kernel build in a
  plain script still says what it is doing rather than looking like a hang; it falls silent
  as soon as the root logger gets a handler, so nothing is printed twice.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

from .errors import EnvError

ROOT = "sparsegen"
FORMAT = "sparsegen: %(message)s"
_SETUP = threading.Lock()


def env_level() -> int:
    """The level the environment asks for: ERROR under SPARSEGEN_QUIET=1, else SPARSEGEN_LOG_LEVEL,
    else INFO. A value env.py cannot read is an EnvError naming the variable."""
    from . import env

    level = getattr(logging, env.log_level())  # both read, so a bad value is never ignored
    return logging.ERROR if env.flag("SPARSEGEN_QUIET") else level


class StderrHandler(logging.Handler):
    """Writes each record as one line to the *current* sys.stderr (looked up per record, so
    click's CliRunner and pytest's capture see it), through tqdm.write when tqdm is loaded so
    that an active progress bar is cleared and redrawn below the message.

    Records still propagate to the root logger (pytest's caplog, a user's handlers). The
    library's default handler (`defer_to_root`) stays silent once the root logger has handlers
    of its own, so a user who configures logging later never sees a line twice."""

    def __init__(self, defer_to_root: bool = False):
        super().__init__()
        self.defer_to_root = defer_to_root

    def emit(self, record: logging.LogRecord) -> None:
        if self.defer_to_root and logging.getLogger().handlers:
            return
        try:
            line = self.format(record)
            tqdm = sys.modules.get("tqdm")
            if tqdm is not None:
                tqdm.tqdm.write(line, file=sys.stderr)
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _install(level: int, *, defer_to_root: bool) -> None:
    root = logging.getLogger(ROOT)
    for handler in list(root.handlers):
        if isinstance(handler, StderrHandler):
            root.removeHandler(handler)
    handler = StderrHandler(defer_to_root)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(level)


def install_cli_handler() -> None:
    """The CLI's handler on the "sparsegen" logger, at the environment's level (replaces any earlier
    one, so a test that invokes the CLI twice gets one handler). Raises EnvError."""
    with _SETUP:
        _install(env_level(), defer_to_root=False)


@functools.cache
def _default_setup() -> None:
    """Done once per process: the level from the environment, and our stderr handler unless the
    user's own logging set-up (a handler on the root or the "sparsegen" logger) is in place."""
    with _SETUP:
        root = logging.getLogger(ROOT)
        try:
            level = env_level()
        except EnvError as exc:
            level = logging.INFO
            root.warning("%s; using info", exc)
        if not root.handlers and not logging.getLogger().handlers:
            _install(level, defer_to_root=True)
        elif root.level == logging.NOTSET:
            root.setLevel(level)


def get_logger(name: str = ROOT) -> logging.Logger:
    """logging.getLogger(name) for a module under "sparsegen", with the default set-up done once."""
    _default_setup()
    return logging.getLogger(name)


def enabled(level: int = logging.INFO) -> bool:
    """Whether a message at `level` from sparsegen would be shown."""
    return logging.getLogger(ROOT).isEnabledFor(level)
