"""Reading one entry back: every level checked (`trusted_fs`), every byte hashed against its manifest."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import trusted_fs as tfs
from .cache_key import KernelKey
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, parse_manifest


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


def inspect_entry(
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
        manifest, problem = parse_manifest(raw, name, key)
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


def disk_bytes(root_fd: int, name: str) -> int:
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
