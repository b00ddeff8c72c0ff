"""File operations under a directory descriptor that never follow a link and trust only our files.

The kernel cache (`cache.py`) reaches everything below its root through these. A path may be
loaded from only if it is a real directory or regular file, owned by this user and not writable
by group or others. The check is an `lstat`, then an open with O_NOFOLLOW, then an `fstat` that
must be the same inode, so a swap between the check and the open is caught.

Removal deletes only what this user owns; a link is unlinked, never followed, and directories go
through shutil.rmtree's descriptor-based walk (which does not follow links either).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import CacheError
from ..log import get_logger

MISSING = "is not in the cache"
QUARANTINE_PREFIX = ".quarantine-"


def uid() -> int:
    return os.getuid()


def kind(mode: int) -> str:
    """'a symlink', 'a directory', 'a regular file', ... for an st_mode."""
    for test, word in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return word
    return "a device"


def untrusted(st: os.stat_result, want_dir: bool) -> str | None:
    """Why a path with this lstat/fstat may not be loaded from, or None if it may."""
    ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not ok:
        return f"is {kind(st.st_mode)}, not {'a directory' if want_dir else 'a regular file'}"
    if st.st_uid != uid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, writable by group or others"
    return None


def open_checked(name: str, dir_fd: int, want_dir: bool) -> tuple[int | None, str | None]:
    """(descriptor, None) on a trusted `name` under `dir_fd`, else (None, why it is not)."""
    try:
        before = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, MISSING
    except OSError as exc:
        return None, f"cannot be examined ({exc.strerror})"
    problem = untrusted(before, want_dir)
    if problem:
        return None, problem
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_DIRECTORY if want_dir else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        return None, f"cannot be opened ({exc.strerror})"
    after = os.fstat(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or untrusted(after, want_dir):
        os.close(fd)
        return None, "changed while it was being checked"
    return fd, None


def read_fd(fd: int, limit: int | None = None) -> bytes:
    """All bytes from `fd` (sized by fstat, as FileIO.readall does), or at most `limit` + 1 of them
    so that the caller can tell the file is too long. The descriptor stays open."""
    with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
        if limit is None:
            return f.readall()
        data = b""
        while len(data) <= limit:
            chunk = f.read(limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
        return data


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Create `name` (it must not exist, and is never a link) holding `data`, mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def remove_if_ours(dir_fd: int, name: str) -> bool:
    """Delete `name` under `dir_fd` if this user owns it; True if it is gone afterwards."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    if st.st_uid != uid():
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    return False


def set_aside(root: Path, dir_fd: int, name: str, why: str) -> None:
    """Rename an untrusted `name` to `.quarantine-*` (a rename never follows a link), then delete
    it if it is ours; what is not ours stays there, and a warning names it."""
    aside = f"{QUARANTINE_PREFIX}{secrets.token_hex(4)}-{name[:200]}"
    try:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CacheError(
            f"cannot move the untrusted cache path {root / name} aside: {exc.strerror}"
        ) from None
    if not remove_if_ours(dir_fd, aside):
        get_logger(__name__).warning(
            "moved %s aside to %s (it %s); it is not ours to delete", name, aside, why
        )


def lock_is_free(dir_fd: int, lock_name: str) -> bool:
    """True if nobody holds the lock `lock_name` (a missing lock is free). A lock that is not our
    regular file counts as held."""
    try:
        fd = os.open(lock_name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if untrusted(os.fstat(fd), want_dir=False):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    finally:
        os.close(fd)  # releases the probe's lock


def _open_lock(root: Path, dir_fd: int, lock_name: str) -> int:
    """A descriptor on our regular lock file (created 0600); an untrusted one is set aside."""
    for _ in range(4):
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(lock_name, flags, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # it vanished between the calls (a dangling link is ELOOP)
                continue
            why = {errno.ELOOP: "is a symlink", errno.EISDIR: "is a directory"}.get(exc.errno, exc.strerror)
            set_aside(root, dir_fd, lock_name, why)
            continue
        st = os.fstat(fd)
        problem = untrusted(st, want_dir=False)
        if problem is None:
            return fd
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid() and st.st_nlink == 1:
            os.fchmod(fd, 0o600)  # our own lock made under a loose umask: tighten it in place
            return fd
        os.close(fd)
        set_aside(root, dir_fd, lock_name, problem)
    raise CacheError(f"cannot take the build lock {root / lock_name}: it keeps being replaced")


def _flock_saying_so(fd: int, label: str, notice_after: float) -> None:
    deadline = time.monotonic() + notice_after
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    get_logger(__name__).info("waiting for %s (locked by another process)", label)
    fcntl.flock(fd, fcntl.LOCK_EX)


@contextlib.contextmanager
def exclusive_lock(
    root: Path, dir_fd: int, lock_name: str, label: str, notice_after: float
) -> Iterator[None]:
    """Hold an exclusive flock on `lock_name` under `dir_fd`; a waiter logs "waiting for <label>"
    after `notice_after` seconds. The lock held is the inode the name points to afterwards."""
    for _ in range(4):
        fd = _open_lock(root, dir_fd, lock_name)
        try:
            _flock_saying_so(fd, label, notice_after)
            try:
                same = os.lstat(lock_name, dir_fd=dir_fd).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # the lock file was replaced while we waited on it: lock the new one
    else:
        raise CacheError(f"cannot take the build lock {root / lock_name}: it keeps being replaced")
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
