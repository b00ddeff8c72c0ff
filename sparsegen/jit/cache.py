"""The kernel cache: two-part keys, one load-or-build path, atomic, defensive, and trusting only our files.

This module is the facade every caller uses (`from sparsegen.jit import cache`); the pieces live
in modules with one job each:

    versions.py     toolchain versions that enter every key
    cache_key.py    KernelKey (readable name + SHA-256) and the hashing
    cache_root.py   the root directory, its checks, and the names that live in it
    manifest.py     an entry's manifest.json: writing and parsing it
    entry_read.py   reading an entry back, every level checked and every byte hashed
    entry_write.py  writing an entry atomically (.tmp-* folder, then rename)
    sweep.py        removing dead builds' .tmp-* folders and quarantined things
    trusted_fs.py   file operations that never follow a link and trust only our files; build locks

An entry is a directory `<cache_dir>/<name>-<digest24>/` holding the build's files plus a
`manifest.json` with each file's SHA-256. Lookup order (DESIGN §5):

    disk -> per-key file lock -> disk again -> build -> atomic rename

(The per-process memo of loaded kernels is `sparsegen.kernels.base`'s, keyed by request; this
module keeps no loaded objects.)

Trust (entries hold code: rendered Python that is imported, cubins that are launched). The root
must be a directory owned by this user and writable by nobody else. Below it, every level is
checked with `lstat` and opened with O_NOFOLLOW, and the opened descriptor's `fstat` must be the
same inode (`trusted_fs.py`): the entry directory, every file in it, the manifest and the lock
file must each be of the right type (a real directory or regular file, never a link), owned by
this user and not writable by group or others. Since only this user can then change anything on
the path, a file that verified stays what the loader reads.

Completeness is the loader's call: `load_or_build(..., required=...)` names the files the kernel
family needs, and an entry whose manifest lists fewer is rebuilt however self-consistent it is.
The entry must also hold exactly the files its manifest lists, and every hash must match.

An entry that fails any check is moved aside to `.quarantine-*` (a rename inside the root,
which never follows a link) and rebuilt; the quarantined thing is deleted only if this user owns
it (links are unlinked, never followed). Stale `.tmp-*` build folders (old, and their key's lock
free) are swept before each build.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import env
from ..errors import CacheError, JitDisabledError
from ..log import get_logger
from . import trusted_fs as tfs
from .cache_key import KernelKey, hash_key
from .cache_root import LOCK_SUFFIX, TMP_PREFIX, cache_dir, is_entry_name, open_root
from .entry_read import Inspection, disk_bytes, inspect_entry
from .entry_write import write_entry
from .manifest import MANIFEST, MAX_FILES, MAX_MANIFEST_BYTES, required_names
from .sweep import STALE_SECONDS, leftover_names, sweep_root
from .trusted_fs import MISSING
from .versions import CACHE_FORMAT_VERSION, NVRTC_WHEELS, nvrtc_version, toolchain_versions

__all__ = [
    "CACHE_FORMAT_VERSION",
    "LOCK_SUFFIX",
    "MANIFEST",
    "MAX_FILES",
    "MAX_MANIFEST_BYTES",
    "NVRTC_WHEELS",
    "STALE_SECONDS",
    "TMP_PREFIX",
    "Inspection",
    "KernelKey",
    "Lookup",
    "cache_dir",
    "clear",
    "entry_path",
    "jit_disabled",
    "leftovers",
    "list_entries",
    "load_or_build",
    "make_key",
    "nvrtc_version",
    "read_entry",
    "sweep",
    "toolchain_versions",
    "verify_entries",
]

WAIT_NOTICE_SECONDS = 1.0  # a waiter on another process's build says so after this long

T = TypeVar("T")

# No module state here: loaded kernels are memoised per request in sparsegen.kernels.base; the
# cache's modules keep only versions.toolchain_versions()'s lru_cache.


def jit_disabled() -> bool:
    return env.flag("SPARSEGEN_DISABLE_JIT")


def make_key(
    name: str, *, spec_json: str, template: bytes, arch: str, extra: dict[str, Any] | None = None
) -> KernelKey:
    """Hash the canonical spec JSON, the template bytes, the toolchain versions and the arch."""
    return hash_key(
        name, spec_json=spec_json, template=template, arch=arch, versions=toolchain_versions(), extra=extra
    )


def entry_path(key: KernelKey) -> Path:
    return cache_dir() / key.key


def read_entry(path: Path, key: KernelKey, *, required: Collection[str]) -> dict[str, Path] | None:
    """The entry's files if every level is trusted, the loader's `required` files are there and
    every hash matches; else None. `path` must be the entry under the cache directory."""
    with open_root() as (root, rfd):
        if Path(path).parent != root:
            raise CacheError(f"{path} is not an entry of the kernel cache {root}")
        found = inspect_entry(root, rfd, Path(path).name, key, required_names(required))
    return dict(found.files) if found.ok else None


def _say(message: str) -> None:
    get_logger(__name__).info(message)  # SPARSEGEN_QUIET=1 / SPARSEGEN_LOG_LEVEL: see sparsegen.log


@dataclass(frozen=True)
class Lookup:
    """What `load_or_build` found: the loaded object and where it came from."""

    value: Any
    status: str  # "cached" (read from disk) | "compiled" (built now)
    path: Path
    seconds: float


def _checked_build(result: Any, label: str) -> tuple[dict[str, bytes], dict[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(x, dict) for x in result)):
        raise CacheError(f"the build of {label} must return (files, meta) dicts, got {type(result).__name__}")
    return result


def load_or_build(
    key: KernelKey,
    build: Callable[[], tuple[dict[str, bytes], dict[str, Any]]],
    load: Callable[[dict[str, Path]], T],
    *,
    required: Collection[str],
    label: str,
) -> Lookup:
    """Return the loaded kernel for `key`, building and storing it on a miss.

    build() -> (files, meta): the entry's file contents and a JSON-able description.
    load(files) -> object: turns the verified files on disk into a usable kernel.
    required: the file names `load` needs; an entry lacking any of them is rebuilt.
    """
    start = time.perf_counter()
    required = required_names(required)
    with open_root() as (root, rfd):
        path = root / key.key
        found = inspect_entry(root, rfd, key.key, key, required)
        status = "cached"
        if not found.ok:
            if jit_disabled():
                raise JitDisabledError(
                    f"kernel {key.key} {found.problem} ({path}) and SPARSEGEN_DISABLE_JIT=1 forbids "
                    "compiling it; run `sparsegen compile` first (with --model-kernels for the model's own kernels)"
                )
            sweep_root(rfd, STALE_SECONDS)  # a build is seconds; listing the root is not
            with tfs.exclusive_lock(root, rfd, key.key + LOCK_SUFFIX, label, WAIT_NOTICE_SECONDS):
                found = inspect_entry(root, rfd, key.key, key, required)
                if not found.ok:
                    if found.problem != MISSING:
                        _say(f"cache entry {key.key} {found.problem}; rebuilding it")
                    _say(f"compiling {label} ...")
                    t0 = time.perf_counter()
                    contents, meta = _checked_build(build(), label)
                    lacking = set(required) - set(contents)
                    if lacking:
                        raise CacheError(f"the build of {label} gave no {', '.join(sorted(lacking))}")
                    write_entry(root, rfd, key, contents, meta, required, found.problem)
                    _say(f"compiled {label} in {time.perf_counter() - t0:.2f} s")
                    found = inspect_entry(root, rfd, key.key, key, required)
                    status = "compiled"
                    if not found.ok:
                        raise CacheError(f"cache entry {path} {found.problem} right after it was written")
    value = load(dict(found.files))
    return Lookup(value, status, path, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Listing, verifying, sweeping, clearing.


def verify_entries() -> list[dict[str, Any]]:
    """Every entry on disk, re-checked and re-hashed: key, path, ok, problem, bytes, meta.

    Anything in the root that is not the cache's own (dot-names, locks) counts as an entry, so a
    stray file or link shows up as a bad one. Completeness here is what the manifest recorded
    the loader required at build time; loading checks the loader's own list.
    """
    out = []
    with open_root() as (root, rfd):
        for name in sorted(os.listdir(rfd)):
            if not is_entry_name(name):
                continue
            found = inspect_entry(root, rfd, name, None, ())
            meta = found.meta if isinstance(found.meta, dict) else {}
            nbytes = found.nbytes if found.ok else disk_bytes(rfd, name)
            out.append(
                {
                    "key": name,
                    "path": str(root / name),
                    "ok": found.ok,
                    "problem": found.problem,
                    "bytes": nbytes,
                    "meta": meta,
                }
            )
    return out


def list_entries() -> list[dict[str, Any]]:
    """Every entry on disk with its manifest metadata and verdict (see verify_entries)."""
    return verify_entries()


def sweep(older_than: float = STALE_SECONDS) -> list[str]:
    """Remove stale `.tmp-*` build folders (a killed build's leftovers) and quarantined entries
    that this user owns. A folder is stale when it is older than `older_than` seconds and its key's
    build lock is free. Returns the names removed."""
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
        raise CacheError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    with open_root() as (_, rfd):
        return sweep_root(rfd, float(older_than))


def leftovers() -> list[str]:
    """Names of `.tmp-*` build folders and `.quarantine-*` paths now in the root."""
    with open_root() as (_, rfd):
        return leftover_names(rfd)


def clear() -> int:
    """Remove every entry, lock file and leftover this user owns (links are unlinked, never
    followed); returns how many entries were removed."""
    removed = 0
    with open_root() as (_, rfd):
        for name in os.listdir(rfd):
            if tfs.remove_if_ours(rfd, name):
                removed += is_entry_name(name)
            else:
                get_logger(__name__).warning(
                    "left %s in the kernel cache: it is not owned by this user", name
                )
    return removed
