"""`PageAllocator`: the KV cache's page ids, shared by reference count, with a prefix cache.

Every usable page is in exactly one of three states:
- empty: no valid content; in `_empty`, handed out first;
- cached: no sequence holds it, but its K/V are still valid and registered under the hash of
  its tokens and prefix (`register`); in `_cached`, least recently released first;
- referenced: held by `refcount(page) >= 1` sequences.

`num_empty + num_cached + num_referenced == capacity` always (`check`). `num_free` counts the
pages `allocate` can hand out: the empty ones, then the cached ones, each evicted (its hash
entry dropped) only when no empty page is left. `lookup(hashes)` finds the longest run of
registered pages for a chain of page hashes, and `share(pages)` takes a reference on each
(a cached page leaves the LRU list). `free` drops one reference per page; a page whose last
reference goes is cached if it is registered, empty otherwise.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from ..errors import CacheOutOfMemory, EngineError

__all__ = ["PageAllocator"]


class PageAllocator:
    """Hands out page ids 0..capacity-1; `allocate` raises instead of waiting for pages."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise CacheOutOfMemory(f"the KV cache needs at least one usable page, got {capacity}")
        self.capacity = capacity
        self._empty: deque[int] = deque(range(capacity))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest release first
        self._refs = [0] * capacity  # references per page
        self._page_of: dict[bytes, int] = {}  # page hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> its registered hash

    # -- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: empty ones and cached ones (evicted on demand)."""
        return len(self._empty) + len(self._cached)

    @property
    def num_empty(self) -> int:
        return len(self._empty)

    @property
    def num_cached(self) -> int:
        """Pages no sequence holds whose registered content is kept for a later hit."""
        return len(self._cached)

    @property
    def num_referenced(self) -> int:
        return self.capacity - len(self._empty) - len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_registered(self, page: int) -> bool:
        return page in self._hash_of

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` pages with one reference each: empty pages first, then the least recently
        released cached pages (their hash entries dropped)."""
        if n > self.num_free:
            raise CacheOutOfMemory(
                f"asked for {n} KV pages but only {self.num_free} of {self.capacity} are free"
            )
        out = []
        for _ in range(n):
            if self._empty:
                page = self._empty.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            out.append(page)
        return out

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page (a sequence's block table, in position order).

        The pages a sequence releases go to the back of the LRU list in reverse position
        order, so its deepest pages (useful only after all those before them) go first."""
        for page in reversed(pages):
            refs = self._refs[page]
            if refs < 1:
                raise EngineError(f"KV page {page} freed but no sequence holds it")
            self._refs[page] = refs - 1
            if refs > 1:
                continue
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._empty.append(page)

    # -- prefix cache ------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages registered under hashes[0], hashes[1], ... up to the first miss."""
        out = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def share(self, pages: list[int]) -> None:
        """Take one more reference on each registered page (a prefix hit)."""
        for page in pages:
            if page not in self._hash_of:
                raise EngineError(f"KV page {page} is shared but holds no registered prefix")
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1

    def register(self, page: int, page_hash: bytes) -> None:
        """Record that referenced `page` now holds the full page named by `page_hash`. If another
        page already holds that content, the first one stays the one found by `lookup`."""
        if self._refs[page] < 1:
            raise EngineError(f"KV page {page} registered but no sequence holds it")
        if page in self._hash_of or page_hash in self._page_of:
            return
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash

    def reset_prefix_cache(self) -> int:
        """Forget every registered prefix; cached pages become empty. Returns how many were."""
        n = len(self._cached)
        self._empty.extend(self._cached)
        self._cached.clear()
        self._page_of = {h: p for h, p in self._page_of.items() if self._refs[p] > 0}
        self._hash_of = {p: h for h, p in self._page_of.items()}
        return n

    def check(self, held: list[list[int]] | None = None) -> None:
        """Raise `EngineError` unless the page accounting holds: every page in exactly one
        state, the hash maps inverse of each other, cached pages registered; with `held` (the
        block tables of every live sequence), each page's references equal its holders."""
        empty, cached = set(self._empty), set(self._cached)
        referenced = {p for p in range(self.capacity) if self._refs[p] > 0}
        problems = []
        if len(empty) != len(self._empty):
            problems.append("a page is twice in the empty list")
        if empty & cached or empty & referenced or cached & referenced:
            problems.append("a page is in two states")
        if len(empty) + len(cached) + len(referenced) != self.capacity:
            problems.append(
                f"{len(empty)} empty + {len(cached)} cached + {len(referenced)} referenced != {self.capacity}"
            )
        if any(r < 0 for r in self._refs):
            problems.append("a negative reference count")
        if any(p not in self._hash_of for p in cached):
            problems.append("a cached page has no registered hash")
        if any(self._page_of.get(h) != p for p, h in self._hash_of.items()) or len(self._page_of) != len(
            self._hash_of
        ):
            problems.append("the page -> hash and hash -> page maps disagree")
        if held is not None:
            counts = [0] * self.capacity
            for table in held:
                for p in table:
                    counts[p] += 1
            wrong = [p for p in range(self.capacity) if counts[p] != self._refs[p]]
            if wrong:
                p = wrong[0]
                problems.append(f"page {p} has {self._refs[p]} references but {counts[p]} holders")
        if problems:
            raise EngineError("KV page accounting broken: " + "; ".join(problems))
