"""A kernel's two-part cache key: a readable name plus a SHA-256 over everything that decides the build."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import CacheError

# File and kernel names: one path component, no leading dot (dot-names are the cache's own).
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}")
HEX64_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class KernelKey:
    """`name` is readable (prefill_bf16_hd128_bs64_l16_v8_...), `digest` is the SHA-256."""

    name: str
    digest: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            raise CacheError(
                f"kernel name {self.name!r} is not a safe file name (letters, digits, _ . + -; at most 200)"
            )
        if not isinstance(self.digest, str) or not HEX64_RE.fullmatch(self.digest):
            raise CacheError(f"kernel digest {self.digest!r} is not a lowercase SHA-256 hex digest")

    @property
    def key(self) -> str:
        """The entry's directory name: `<name>-<first 24 hex digits of the digest>`."""
        return f"{self.name}-{self.digest[:24]}"


def hash_key(
    name: str,
    *,
    spec_json: str,
    template: bytes,
    arch: str,
    versions: dict[str, str],
    extra: dict[str, Any] | None = None,
) -> KernelKey:
    """Hash the canonical spec JSON, the template bytes, the toolchain `versions` and the arch
    (plus `extra`, key order irrelevant) into a key named `name`."""
    payload = {
        "spec": spec_json,
        "template_sha256": hashlib.sha256(template).hexdigest(),
        "versions": versions,
        "arch": arch,
        "extra": extra or {},
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return KernelKey(name, hashlib.sha256(text.encode()).hexdigest())
