"""Automatic prefix caching: the hash chain that names a full KV page by its content.

A full page of `page_size` tokens is named by blake2b over the digest of the page before it
(or, for a sequence's first page, a root digest) and the page's token ids as little-endian
int64 bytes. The root digest covers everything else that changes what a page holds: the
cache's salt (the KV dtype and page size, from the engine) and whether the sequence's prompt
is long enough for LongRoPE's long factors, which then apply to every prompt position (see
`runner.model_runner.ModelRunner.use_long_rope`). Equal pages after different prefixes, or
under another KV dtype, therefore get different names.

`PrefixCounters` counts, for the engine's stats, the tokens looked up at admission and those
found in the cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..request.sequence import Sequence

__all__ = ["PrefixCounters", "cache_salt", "chain_hash", "extend_page_hashes", "root_digest"]

DIGEST_SIZE = 32


def cache_salt(**facts: object) -> bytes:
    """The engine-wide part of every root digest: `facts` (e.g. kv_dtype, page_size) in a
    fixed order."""
    return "|".join(f"{k}={facts[k]}" for k in sorted(facts)).encode()


def root_digest(salt: bytes, long_rope: bool) -> bytes:
    """The parent digest of a sequence's first page."""
    return hashlib.blake2b(salt + (b"\x01" if long_rope else b"\x00"), digest_size=DIGEST_SIZE).digest()


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The name of a full page holding `token_ids` after the pages whose last name is `parent`."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


def extend_page_hashes(seq: Sequence, num_pages: int, page_size: int, root: bytes) -> list[bytes]:
    """`seq.page_hashes` grown to (at least) its first `num_pages` full pages; the tokens only
    ever grow, so names computed once stay right."""
    hashes = seq.page_hashes
    if len(hashes) < num_pages:
        tokens = seq.tokens
        parent = hashes[-1] if hashes else root
        for i in range(len(hashes), num_pages):
            parent = chain_hash(parent, tokens[i * page_size : (i + 1) * page_size])
            hashes.append(parent)
    return hashes


@dataclass
class PrefixCounters:
    """Tokens of sequences admitted with caching on (`queries`) and those of them that were
    already in the cache (`hits`), since the engine started."""

    queries: int = 0
    hits: int = 0
