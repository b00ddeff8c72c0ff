"""The kernel cache: two-part keys, one load-or-build path, atomic and defensive.

An entry is a directory `<cache_dir>/<name>-<digest>/` holding the build's files plus a
`manifest.json` with each file's SHA-256. Lookup order (DESIGN §5):

    memory -> disk -> per-key file lock -> disk again -> build -> atomic rename

A build is written to a temporary directory next to the entry and renamed into place, so a
reader sees either nothing or a complete entry. An entry that fails to verify (truncated file,
wrong hash, wrong key) is rebuilt, never trusted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from .. import env
from ..errors import CacheError, JitDisabledError

CACHE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"

T = TypeVar("T")

# The one piece of module-level mutable state: loaded kernels, by key string.
_MEMORY: dict[str, Any] = {}


def cache_dir() -> Path:
    """`env.cache_dir()` (SPARSEGEN_CACHE_DIR, XDG_CACHE_HOME, ~/.cache); created private, refused if unsafe.

    Entries hold code (rendered Python, cubins), so the directory must belong to this user
    and be writable by nobody else.
    """
    root = env.cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = root.stat()
    except OSError as exc:
        raise CacheError(f"cannot create the kernel cache directory {root}: {exc}") from None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheError(
            f"kernel cache directory {root} is not owned by this user; refusing to load code from it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"kernel cache directory {root} is writable by group or others; "
            f"refusing to load code from it (chmod go-w {root})"
        )
    return root


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


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_entry(path: Path, key: KernelKey) -> dict[str, Path] | None:
    """The entry's files if it is complete and every hash matches, else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("key") != key.key or manifest.get("digest") != key.digest:
            return None
        files = {}
        for fname, digest in manifest["files"].items():
            fpath = path / fname
            if _sha256_file(fpath) != digest:
                return None
            files[fname] = fpath
        return files
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_entry(path: Path, key: KernelKey, files: dict[str, bytes], meta: dict[str, Any]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key.key}-", dir=path.parent))
    try:
        for fname, data in files.items():
            if "/" in fname or fname in ("", ".", "..", MANIFEST):
                raise CacheError(f"invalid cache file name {fname!r}")
            (tmp / fname).write_bytes(data)
        manifest = {
            "key": key.key,
            "digest": key.digest,
            "files": {f: hashlib.sha256(d).hexdigest() for f, d in files.items()},
            "meta": meta,
            "created": time.time(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if path.exists():  # a corrupt entry: we hold the lock, so nobody else is using it
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _say(message: str) -> None:
    if not env.flag("SPARSEGEN_QUIET"):
        print(f"sparsegen: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Lookup:
    """What `load_or_build` found: the loaded object and where it came from."""

    value: Any
    status: str  # "memory" | "cached" | "compiled"
    path: Path
    seconds: float


def load_or_build(
    key: KernelKey,
    build: Callable[[], tuple[dict[str, bytes], dict[str, Any]]],
    load: Callable[[dict[str, Path]], T],
    *,
    label: str,
) -> Lookup:
    """Return the loaded kernel for `key`, building and storing it on a miss.

    build() -> (files, meta): the entry's file contents and a JSON-able description.
    load(files) -> object: turns the verified files on disk into a usable kernel.
    """
    start = time.perf_counter()
    hit = _MEMORY.get(key.key)
    path = entry_path(key)
    if hit is not None:
        return Lookup(hit, "memory", path, time.perf_counter() - start)
    files = read_entry(path, key)
    status = "cached"
    if files is None:
        if jit_disabled():
            reason = "is corrupt" if path.exists() else "is not in the cache"
            raise JitDisabledError(
                f"kernel {key.key} {reason} ({path}) and SPARSEGEN_DISABLE_JIT=1 forbids compiling it; "
                "run `sparsegen compile` first"
            )
        with FileLock(str(path) + ".lock"):
            files = read_entry(path, key)
            if files is None:
                if path.exists():
                    _say(f"cache entry {path.name} failed verification; rebuilding it")
                _say(f"compiling {label} ...")
                t0 = time.perf_counter()
                contents, meta = build()
                _write_entry(path, key, contents, meta)
                _say(f"compiled {label} in {time.perf_counter() - t0:.2f} s")
                files = read_entry(path, key)
                status = "compiled"
                if files is None:
                    raise CacheError(f"cache entry {path} did not verify right after it was written")
    value = load(files)
    _MEMORY[key.key] = value
    return Lookup(value, status, path, time.perf_counter() - start)


def list_entries() -> list[dict[str, Any]]:
    """Every entry on disk with its manifest metadata (unreadable ones marked corrupt)."""
    out = []
    for path in sorted(cache_dir().iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            size = sum(f.stat().st_size for f in path.iterdir())
            out.append({"key": path.name, "path": str(path), "bytes": size, "meta": manifest.get("meta", {})})
        except (OSError, ValueError):
            out.append({"key": path.name, "path": str(path), "bytes": 0, "meta": {"corrupt": True}})
    return out


def clear() -> int:
    """Remove every entry and lock file; returns how many entries were removed."""
    root = cache_dir()
    removed = 0
    for path in root.iterdir():
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed += not path.name.startswith(".")
        elif path.suffix == ".lock":
            path.unlink(missing_ok=True)
    _MEMORY.clear()
    return removed


def forget_memory() -> None:
    """Drop the in-memory layer (tests use it to force a disk read)."""
    _MEMORY.clear()
