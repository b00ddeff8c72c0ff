"""An entry's `manifest.json`: the SHA-256 of each of its files, what its loader required, its metadata.

Writing checks the build's files; parsing checks every field of a manifest read back from disk
and says, in one phrase, what is wrong with a bad one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection
from typing import Any

from ..errors import CacheError
from .cache_key import HEX64_RE, NAME_RE, KernelKey

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILES = 64


def _is_file_name(name: object) -> bool:
    return isinstance(name, str) and name != MANIFEST and NAME_RE.fullmatch(name) is not None


def required_names(required: Collection[str]) -> tuple[str, ...]:
    """The loader's required file names, checked and sorted."""
    if isinstance(required, (str, bytes)) or not all(isinstance(r, str) for r in required):
        raise CacheError(f"required must be a collection of file names, got {required!r}")
    bad = [r for r in required if not _is_file_name(r)]
    if bad:
        raise CacheError(f"invalid required cache file name(s) {bad!r}")
    return tuple(sorted(set(required)))


def encode_manifest(
    key: KernelKey, files: dict[str, bytes], meta: dict[str, Any], required: tuple[str, ...]
) -> bytes:
    """The manifest of a build's `files` (checked: safe names, bytes, 1 to MAX_FILES of them)."""
    for fname, data in files.items():
        if not _is_file_name(fname):
            raise CacheError(f"invalid cache file name {fname!r}")
        if not isinstance(data, (bytes, bytearray)):
            raise CacheError(f"cache file {fname} must be bytes, got {type(data).__name__}")
    if not 0 < len(files) <= MAX_FILES:
        raise CacheError(f"a cache entry holds 1 to {MAX_FILES} files, the build gave {len(files)}")
    try:
        return json.dumps(
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


def parse_manifest(data: bytes, name: str, key: KernelKey | None) -> tuple[dict | None, str | None]:
    """The manifest of entry `name` (for `key`, when given) as a checked dict, or (None, why)."""
    if len(data) > MAX_MANIFEST_BYTES:
        return None, f"has a manifest larger than {MAX_MANIFEST_BYTES} bytes"
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, "has a manifest that is not valid JSON (or is nested too deeply)"
    if not isinstance(manifest, dict):
        return None, f"has a manifest that is a JSON {type(manifest).__name__}, not an object"
    digest, files = manifest.get("digest"), manifest.get("files")
    if not isinstance(digest, str) or not HEX64_RE.fullmatch(digest):
        return None, "has a manifest whose 'digest' is not a SHA-256 hex digest"
    if manifest.get("key") != name or not name.endswith(f"-{digest[:24]}"):
        return None, "has a manifest for another key"
    if key is not None and (manifest["key"] != key.key or digest != key.digest):
        return None, "has a manifest for another key"
    if not isinstance(files, dict) or not 0 < len(files) <= MAX_FILES:
        return None, f"has a manifest whose 'files' is not an object of 1 to {MAX_FILES} entries"
    for fname, fdigest in files.items():
        if not _is_file_name(fname):
            return None, f"has a manifest naming an invalid file {fname[:80]!r}"
        if not isinstance(fdigest, str) or not HEX64_RE.fullmatch(fdigest):
            return None, f"has a manifest whose hash for {fname} is not a SHA-256 hex digest"
    meta, required = manifest.get("meta", {}), manifest.get("required", [])
    if not isinstance(meta, dict):
        return None, "has a manifest whose 'meta' is not an object"
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return None, "has a manifest whose 'required' is not a list of names"
    return manifest, None
