"""Writing one entry atomically: build it in `.tmp-<key>-<random>/`, then rename it into place.

The caller holds the key's build lock (`trusted_fs.exclusive_lock`), so the only rivals are
readers, and a reader sees either nothing or a complete entry.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from ..errors import CacheError
from . import trusted_fs as tfs
from .cache_key import KernelKey
from .cache_root import TMP_PREFIX
from .manifest import MANIFEST, encode_manifest


def write_entry(
    root: Path,
    root_fd: int,
    key: KernelKey,
    files: dict[str, bytes],
    meta: dict[str, Any],
    required: tuple[str, ...],
    why: str | None = None,
) -> None:
    """Write the entry into `.tmp-<key>-<random>` and rename it into place (the key's lock held).

    A bad entry already at the key's place is moved aside first (quarantined, saying `why`).
    """
    manifest = encode_manifest(key, files, meta, required)
    tmp = f"{TMP_PREFIX}{key.key}-{secrets.token_hex(4)}"
    try:
        os.mkdir(tmp, 0o700, dir_fd=root_fd)
    except OSError as exc:
        raise CacheError(f"cannot write the cache entry {root / key.key}: {exc.strerror}") from None
    try:
        dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        try:
            os.fchmod(dfd, 0o700)
            for fname, data in files.items():
                tfs.write_file(dfd, fname, bytes(data))
            tfs.write_file(dfd, MANIFEST, manifest)
        finally:
            os.close(dfd)
        try:
            os.lstat(key.key, dir_fd=root_fd)
            tfs.set_aside(root, root_fd, key.key, why or "failed verification")  # we hold the lock
        except FileNotFoundError:
            pass
        os.rename(tmp, key.key, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except OSError as exc:  # a full disk, a quota: one line, and the half-written folder goes
        tfs.remove_if_ours(root_fd, tmp)
        raise CacheError(f"cannot write the cache entry {root / key.key}: {exc.strerror}") from None
    except BaseException:
        tfs.remove_if_ours(root_fd, tmp)
        raise
