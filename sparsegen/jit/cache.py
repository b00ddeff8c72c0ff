"""The kernel cache: two-part keys, one load-or-build path, atomic, defensive, and trusting only our files.

An entry is a directory `<cache_dir>/<name>-<digest24>/` holding the build's files plus a
`manifest.json` with each file's SHA-256. Lookup order (DESIGN §5):

    memory -> disk -> per-key file lock -> disk again -> build -> atomic rename

A build is written to a temporary directory `.tmp-<key>-<random>` next to the entry and renamed
into place, so a reader sees either nothing or a complete entry.

Trust (entries hold code: rendered Python that is imported, cubins that are launched). The root
must be a directory owned by this user and writable by nobody else. Below it, every level is
checked with `lstat` and opened with O_NOFOLLOW, and the opened descriptor's `fstat` must be the
same inode (`trusted_fs.py`): the entry directory, every file in it, the manifest and the lock file must each be
of the right type (a real directory or regular file, never a link), owned by this user and not
writable by group or others. Since only this user can then change anything on the path, a file
that verified stays what the loader reads.

Completeness is the loader's call: `load_or_build(..., required=...)` names the files the kernel
family needs, and an entry whose manifest lists fewer is rebuilt however self-consistent it is.
The entry must also hold exactly the files its manifest lists, and every hash must match.

An entry that fails any check is moved aside to `.quarantine-*` (a rename inside the root,
which never follows a link) and rebuilt; the quarantined thing is deleted only if this user owns
it (links are unlinked, never followed). Stale `.tmp-*` build folders (old, and their key's lock
free) are swept before each build.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .. import env
from ..errors import CacheError, JitDisabledError
from ..log import get_logger
from . import trusted_fs as tfs
from .trusted_fs import MISSING, QUARANTINE_PREFIX

CACHE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK_SUFFIX = ".lock"
TMP_PREFIX = ".tmp-"
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILES = 64
STALE_SECONDS = 300.0  # a .tmp-* folder this old whose lock is free is a dead build's leftover
WAIT_NOTICE_SECONDS = 1.0  # a waiter on another process's build says so after this long
# File and kernel names: one path component, no leading dot (dot-names are the cache's own).
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")

T = TypeVar("T")

# Loaded kernels by key string: a cache of objects built from verified entries (forget_memory()
# empties it). The module's other state is toolchain_versions()'s lru_cache.
_MEMORY: dict[str, Any] = {}


def _check_root(root: Path, st: os.stat_result) -> None:
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
    _check_root(root, st)
    return root


@contextlib.contextmanager
def _open_root() -> Iterator[tuple[Path, int]]:
    """The checked root and a descriptor on it; everything below is reached relative to it."""
    root = cache_dir()
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise CacheError(f"cannot open the kernel cache directory {root}: {exc.strerror}") from None
    try:
        _check_root(root, os.fstat(fd))  # the directory we opened is the one we checked
        yield root, fd
    finally:
        os.close(fd)


def jit_disabled() -> bool:
    return env.flag("SPARSEGEN_DISABLE_JIT")


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> dict[str, str]:
    """Versions that change what a build produces; all of them enter every key."""
    import torch
    import triton

    return {  # read-only: lru_cache hands every caller the same dict
        "cache_format": str(CACHE_FORMAT_VERSION),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "nvrtc": nvrtc_version(),
    }


NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12")


def nvrtc_version() -> str:
    """The NVRTC that cuda-core compiles with. Read from the installed NVRTC wheel of the same CUDA
    major as cuda-bindings (the library cuda-core loads first) without loading it: loading the
    library took about half a second of a warm `sparsegen compile` on the H200. Without such a
    wheel, the library is loaded and asked."""
    from importlib import metadata

    try:
        major = metadata.version("cuda-bindings").split(".")[0]
        for dist in NVRTC_WHEELS:
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            if version.split(".")[0] == major:
                return version
    except metadata.PackageNotFoundError:
        pass
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}" if int(err) == 0 else "unavailable"
    except Exception:  # noqa: BLE001 - any failure to load NVRTC means "no NVRTC"
        return "unavailable"


@dataclass(frozen=True)
class KernelKey:
    """`name` is readable (prefill_bf16_hd128_bs64_l16_v8_...), `digest` is the SHA-256."""

    name: str
    digest: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise CacheError(
                f"kernel name {self.name!r} is not a safe file name (letters, digits, _ . + -; at most 200)"
            )
        if not isinstance(self.digest, str) or not _HEX64_RE.fullmatch(self.digest):
            raise CacheError(f"kernel digest {self.digest!r} is not a lowercase SHA-256 hex digest")

    @property
    def key(self) -> str:
        return f"{self.name}-{self.digest[:24]}"


def make_key(
    name: str, *, spec_json: str, template: bytes, arch: str, extra: dict[str, Any] | None = None
) -> KernelKey:
    """Hash the canonical spec JSON, the template bytes, the toolchain versions and the arch."""
    payload = {
        "spec": spec_json,
        "template_sha256": hashlib.sha256(template).hexdigest(),
        "versions": toolchain_versions(),
        "arch": arch,
        "extra": extra or {},
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return KernelKey(name, hashlib.sha256(text.encode()).hexdigest())


def entry_path(key: KernelKey) -> Path:
    return cache_dir() / key.key


# ---------------------------------------------------------------------------------------------
# Reading an entry: every level checked, every byte hashed.


@dataclass(frozen=True)
class Inspection:
    """What reading one entry found: `problem` is None when the entry may be loaded."""

    name: str
    problem: str | None
    files: dict[str, Path] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.problem is None


def _parse_manifest(data: bytes, name: str, key: KernelKey | None) -> tuple[dict | None, str | None]:
    """The manifest as a checked dict, or (None, why)."""
    if len(data) > MAX_MANIFEST_BYTES:
        return None, f"has a manifest larger than {MAX_MANIFEST_BYTES} bytes"
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, "has a manifest that is not valid JSON (or is nested too deeply)"
    if not isinstance(manifest, dict):
        return None, f"has a manifest that is a JSON {type(manifest).__name__}, not an object"
    digest, files = manifest.get("digest"), manifest.get("files")
    if not isinstance(digest, str) or not _HEX64_RE.fullmatch(digest):
        return None, "has a manifest whose 'digest' is not a SHA-256 hex digest"
    if manifest.get("key") != name or not name.endswith(f"-{digest[:24]}"):
        return None, "has a manifest for another key"
    if key is not None and (manifest["key"] != key.key or digest != key.digest):
        return None, "has a manifest for another key"
    if not isinstance(files, dict) or not 0 < len(files) <= MAX_FILES:
        return None, f"has a manifest whose 'files' is not an object of 1 to {MAX_FILES} entries"
    for fname, fdigest in files.items():
        if fname == MANIFEST or not _NAME_RE.fullmatch(fname):
            return None, f"has a manifest naming an invalid file {fname[:80]!r}"
        if not isinstance(fdigest, str) or not _HEX64_RE.fullmatch(fdigest):
            return None, f"has a manifest whose hash for {fname} is not a SHA-256 hex digest"
    meta, required = manifest.get("meta", {}), manifest.get("required", [])
    if not isinstance(meta, dict):
        return None, "has a manifest whose 'meta' is not an object"
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return None, "has a manifest whose 'required' is not a list of names"
    return manifest, None


def _inspect(
    root: Path, root_fd: int, name: str, key: KernelKey | None, required: Collection[str]
) -> Inspection:
    """Check entry `name` under the root at every level and hash every file it holds.

    `key` None (listing, verify): the manifest must match the directory's own name, and the
    required files are those the manifest recorded at build time.
    """
    dfd, problem = tfs.open_checked(name, root_fd, want_dir=True)
    if dfd is None:
        return Inspection(name, problem)
    try:
        present = set(os.listdir(dfd))
        if MANIFEST not in present:
            return Inspection(name, "has no manifest.json")
        mfd, problem = tfs.open_checked(MANIFEST, dfd, want_dir=False)
        if mfd is None:
            return Inspection(name, f"has a manifest.json that {problem}")
        try:
            raw = tfs.read_fd(mfd, MAX_MANIFEST_BYTES)
        finally:
            os.close(mfd)
        manifest, problem = _parse_manifest(raw, name, key)
        if manifest is None:
            return Inspection(name, problem)
        meta, listed = manifest.get("meta", {}), manifest["files"]
        needed = set(required) if key is not None else set(manifest.get("required", []))
        if needed - set(listed):
            return Inspection(
                name, f"lacks required file(s) {', '.join(sorted(needed - set(listed)))}", meta=meta
            )
        extra, absent = present - set(listed) - {MANIFEST}, set(listed) - present
        if absent:
            return Inspection(name, f"lacks {', '.join(sorted(absent))} listed in its manifest", meta=meta)
        if extra:
            shown = ", ".join(repr(x[:80]) for x in sorted(extra)[:3])
            return Inspection(name, f"holds file(s) its manifest does not list: {shown}", meta=meta)
        nbytes = len(raw)
        for fname, fdigest in listed.items():
            ffd, problem = tfs.open_checked(fname, dfd, want_dir=False)
            if ffd is None:
                return Inspection(name, f"has a file {fname} that {problem}", meta=meta)
            try:
                data = tfs.read_fd(ffd)
            finally:
                os.close(ffd)
            if hashlib.sha256(data).hexdigest() != fdigest:
                return Inspection(
                    name, f"has a file {fname} that does not match its hash (truncated or edited)", meta=meta
                )
            nbytes += len(data)
        files = {fname: root / name / fname for fname in listed}
        return Inspection(name, None, files, meta, nbytes)
    except OSError as exc:
        return Inspection(name, f"cannot be read ({exc.strerror})")
    finally:
        os.close(dfd)


def _required_names(required: Collection[str]) -> tuple[str, ...]:
    if isinstance(required, (str, bytes)) or not all(isinstance(r, str) for r in required):
        raise CacheError(f"required must be a collection of file names, got {required!r}")
    bad = [r for r in required if r == MANIFEST or not _NAME_RE.fullmatch(r)]
    if bad:
        raise CacheError(f"invalid required cache file name(s) {bad!r}")
    return tuple(sorted(set(required)))


def read_entry(path: Path, key: KernelKey, *, required: Collection[str]) -> dict[str, Path] | None:
    """The entry's files if every level is trusted, the loader's `required` files are there and
    every hash matches; else None. `path` must be the entry under the cache directory."""
    with _open_root() as (root, rfd):
        if Path(path).parent != root:
            raise CacheError(f"{path} is not an entry of the kernel cache {root}")
        found = _inspect(root, rfd, Path(path).name, key, _required_names(required))
    return dict(found.files) if found.ok else None


# ---------------------------------------------------------------------------------------------
# Moving bad things aside, removing our own leftovers.


def _key_of_tmp(name: str) -> str:
    return name[len(TMP_PREFIX) :].rsplit("-", 1)[0]


def _sweep(root_fd: int, older_than: float) -> list[str]:
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
        if tfs.lock_is_free(root_fd, _key_of_tmp(name) + LOCK_SUFFIX) and tfs.remove_if_ours(root_fd, name):
            removed.append(name)
    return removed


def sweep(older_than: float = STALE_SECONDS) -> list[str]:
    """Remove stale `.tmp-*` build folders (a killed build's leftovers) and quarantined entries
    that this user owns. A folder is stale when it is older than `older_than` seconds and its key's
    build lock is free. Returns the names removed."""
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
        raise CacheError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    with _open_root() as (_, rfd):
        return _sweep(rfd, float(older_than))


# ---------------------------------------------------------------------------------------------
# Writing an entry.


def _write_entry(
    root: Path,
    root_fd: int,
    key: KernelKey,
    files: dict[str, bytes],
    meta: dict[str, Any],
    required: tuple,
    why: str | None = None,
) -> None:
    """Write the entry into `.tmp-<key>-<random>` and rename it into place (the key's lock held)."""
    for fname, data in files.items():
        if not isinstance(fname, str) or fname == MANIFEST or not _NAME_RE.fullmatch(fname):
            raise CacheError(f"invalid cache file name {fname!r}")
        if not isinstance(data, (bytes, bytearray)):
            raise CacheError(f"cache file {fname} must be bytes, got {type(data).__name__}")
    if not 0 < len(files) <= MAX_FILES:
        raise CacheError(f"a cache entry holds 1 to {MAX_FILES} files, the build gave {len(files)}")
    try:
        manifest = json.dumps(
            {
                "key": key.key,
                "digest": key.digest,
                "files": {f: hashlib.sha256(d).hexdigest() for f, d in files.items()},
                "required": list(required),
                "meta": meta,
                "created": time.time(),
            },
            indent=1,
            sort_keys=True,
        ).encode()
    except (TypeError, ValueError) as exc:
        raise CacheError(f"the metadata of {key.key} is not JSON: {exc}") from None
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


def _say(message: str) -> None:
    get_logger(__name__).info(message)  # SPARSEGEN_QUIET=1 / SPARSEGEN_LOG_LEVEL: see sparsegen.log


@dataclass(frozen=True)
class Lookup:
    """What `load_or_build` found: the loaded object and where it came from."""

    value: Any
    status: str  # "memory" | "cached" | "compiled"
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
    hit = _MEMORY.get(key.key)
    if hit is not None:
        return Lookup(hit, "memory", entry_path(key), time.perf_counter() - start)
    required = _required_names(required)
    with _open_root() as (root, rfd):
        path = root / key.key
        found = _inspect(root, rfd, key.key, key, required)
        status = "cached"
        if not found.ok:
            if jit_disabled():
                raise JitDisabledError(
                    f"kernel {key.key} {found.problem} ({path}) and SPARSEGEN_DISABLE_JIT=1 forbids "
                    "compiling it; run `sparsegen compile` first"
                )
            _sweep(rfd, STALE_SECONDS)  # a build is seconds; listing the root is not
            with tfs.exclusive_lock(root, rfd, key.key + LOCK_SUFFIX, label, WAIT_NOTICE_SECONDS):
                found = _inspect(root, rfd, key.key, key, required)
                if not found.ok:
                    if found.problem != MISSING:
                        _say(f"cache entry {key.key} {found.problem}; rebuilding it")
                    _say(f"compiling {label} ...")
                    t0 = time.perf_counter()
                    contents, meta = _checked_build(build(), label)
                    lacking = set(required) - set(contents)
                    if lacking:
                        raise CacheError(f"the build of {label} gave no {', '.join(sorted(lacking))}")
                    _write_entry(root, rfd, key, contents, meta, required, found.problem)
                    _say(f"compiled {label} in {time.perf_counter() - t0:.2f} s")
                    found = _inspect(root, rfd, key.key, key, required)
                    status = "compiled"
                    if not found.ok:
                        raise CacheError(f"cache entry {path} {found.problem} right after it was written")
    value = load(dict(found.files))
    _MEMORY[key.key] = value
    return Lookup(value, status, path, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Listing, verifying, clearing.


def _is_entry_name(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(LOCK_SUFFIX)


def _disk_bytes(root_fd: int, name: str) -> int:
    """Bytes a (bad) entry takes: its own size, plus its children's if it is a real directory."""
    try:
        st = os.lstat(name, dir_fd=root_fd)
        if not stat.S_ISDIR(st.st_mode):
            return st.st_size
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return 0
    try:
        return sum(os.lstat(child, dir_fd=dfd).st_size for child in os.listdir(dfd))
    except OSError:
        return 0
    finally:
        os.close(dfd)


def verify_entries() -> list[dict[str, Any]]:
    """Every entry on disk, re-checked and re-hashed: key, path, ok, problem, bytes, meta.

    Anything in the root that is not the cache's own (dot-names, locks) counts as an entry, so a
    stray file or link shows up as a bad one. Completeness here is what the manifest recorded
    the loader required at build time; loading checks the loader's own list.
    """
    out = []
    with _open_root() as (root, rfd):
        for name in sorted(os.listdir(rfd)):
            if not _is_entry_name(name):
                continue
            found = _inspect(root, rfd, name, None, ())
            meta = found.meta if isinstance(found.meta, dict) else {}
            nbytes = found.nbytes if found.ok else _disk_bytes(rfd, name)
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


def leftovers() -> list[str]:
    """Names of `.tmp-*` build folders and `.quarantine-*` paths now in the root."""
    with _open_root() as (_, rfd):
        return sorted(n for n in os.listdir(rfd) if n.startswith((TMP_PREFIX, QUARANTINE_PREFIX)))


def clear() -> int:
    """Remove every entry, lock file and leftover this user owns (links are unlinked, never
    followed); returns how many entries were removed."""
    removed = 0
    with _open_root() as (_, rfd):
        for name in os.listdir(rfd):
            if tfs.remove_if_ours(rfd, name):
                removed += _is_entry_name(name)
            else:
                get_logger(__name__).warning(
                    "left %s in the kernel cache: it is not owned by this user", name
                )
    _MEMORY.clear()
    return removed


def forget_memory() -> None:
    """Drop the in-memory layer (tests use it to force a disk read)."""
    _MEMORY.clear()
