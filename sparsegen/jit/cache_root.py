"""The cache root: where it is, the checks that let us load code from it, and what lives in it.

The root holds entries `<key>/`, their build locks `<key>.lock`, builds in progress
`.tmp-<key>-<random>/` and things moved aside `.quarantine-*` (see `trusted_fs`). Dot-names and
locks are the cache's own; anything else is an entry (or something posing as one).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from .. import env
from ..errors import CacheError
from . import trusted_fs as tfs

LOCK_SUFFIX = ".lock"
TMP_PREFIX = ".tmp-"


def is_entry_name(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(LOCK_SUFFIX)


def key_of_tmp(name: str) -> str:
    """The key a `.tmp-<key>-<random>` build folder is building."""
    return name[len(TMP_PREFIX) :].rsplit("-", 1)[0]


def check_root(root: Path, st: os.stat_result) -> None:
    """Refuse a root that is not a directory of this user's that nobody else can write."""
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"kernel cache directory {root} is {tfs.kind(st.st_mode)}, not a directory")
    if st.st_uid != tfs.uid():
        raise CacheError(
            f"kernel cache directory {root} is not owned by this user; refusing to load code from it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"kernel cache directory {root} is writable by group or others; "
            f"refusing to load code from it (chmod go-w {root})"
        )


def cache_dir() -> Path:
    """`env.cache_dir()` (SPARSEGEN_CACHE_DIR, XDG_CACHE_HOME, ~/.cache); created private, refused if unsafe.

    Entries hold code (rendered Python, cubins), so the directory must belong to this user
    and be writable by nobody else. The root itself may be a link the user made; nothing
    below it may be.
    """
    root = env.cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = root.stat()
    except OSError as exc:
        raise CacheError(f"cannot create the kernel cache directory {root}: {exc}") from None
    check_root(root, st)
    return root


@contextlib.contextmanager
def open_root() -> Iterator[tuple[Path, int]]:
    """The checked root and a descriptor on it; everything below is reached relative to it."""
    root = cache_dir()
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise CacheError(f"cannot open the kernel cache directory {root}: {exc.strerror}") from None
    try:
        check_root(root, os.fstat(fd))  # the directory we opened is the one we checked
        yield root, fd
    finally:
        os.close(fd)
