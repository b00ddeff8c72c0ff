"""Removing our own leftovers: dead builds' `.tmp-*` folders and quarantined `.quarantine-*` things."""

from __future__ import annotations

import os
import time

from . import trusted_fs as tfs
from .cache_root import LOCK_SUFFIX, TMP_PREFIX, key_of_tmp
from .trusted_fs import QUARANTINE_PREFIX

STALE_SECONDS = 300.0  # a .tmp-* folder this old whose lock is free is a dead build's leftover


def sweep_root(root_fd: int, older_than: float) -> list[str]:
    """Remove our stale `.tmp-*` build folders (older than `older_than` s, key lock free) and our
    quarantined leftovers. Returns the names removed."""
    removed, now = [], time.time()
    for name in os.listdir(root_fd):
        if name.startswith(QUARANTINE_PREFIX):
            if tfs.remove_if_ours(root_fd, name):
                removed.append(name)
            continue
        if not name.startswith(TMP_PREFIX):
            continue
        try:
            st = os.lstat(name, dir_fd=root_fd)
        except FileNotFoundError:
            continue
        if now - st.st_mtime < older_than or st.st_uid != tfs.uid():
            continue
        if tfs.lock_is_free(root_fd, key_of_tmp(name) + LOCK_SUFFIX) and tfs.remove_if_ours(root_fd, name):
            removed.append(name)
    return removed


def leftover_names(root_fd: int) -> list[str]:
    """Names of `.tmp-*` build folders and `.quarantine-*` paths now in the root."""
    return sorted(n for n in os.listdir(root_fd) if n.startswith((TMP_PREFIX, QUARANTINE_PREFIX)))
