"""The page allocator's reference counts, prefix registry and LRU list, and the page hash chain."""

from __future__ import annotations

import random

import pytest

from sparsegen.engine.prefix_cache import cache_salt, chain_hash, extend_page_hashes, root_digest
from sparsegen.errors import CacheOutOfMemory, EngineError, InputError
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.request.sequence import Sequence
from sparsegen.runner.config import EngineConfig
from sparsegen.runner.page_pool import PageAllocator

H = [bytes([i]) * 32 for i in range(8)]  # stand-in page hashes


def test_shared_pages_count_references_and_come_back_once():
    alloc = PageAllocator(4)
    a = alloc.allocate(2)
    alloc.register(a[0], H[0])
    alloc.register(a[1], H[1])
    assert alloc.lookup([H[0], H[1], H[2]]) == a
    alloc.share(a)
    assert [alloc.refcount(p) for p in a] == [2, 2]
    alloc.free(a)  # the first holder goes: still referenced
    assert alloc.num_referenced == 2 and alloc.num_cached == 0 and alloc.num_free == 2
    alloc.free(a)
    assert alloc.num_referenced == 0 and alloc.num_cached == 2 and alloc.num_free == 4
    alloc.check([])
    with pytest.raises(EngineError, match="freed but no sequence holds it"):
        alloc.free([a[0]])


def test_lru_evicts_empty_pages_first_then_the_oldest_cached_page():
    alloc = PageAllocator(3)
    x, y = alloc.allocate(1), alloc.allocate(1)
    alloc.register(x[0], H[0])
    alloc.register(y[0], H[1])
    alloc.free(x)
    alloc.free(y)  # LRU order: x (released first), then y
    assert alloc.allocate(1) == [2]  # the empty page goes before any cached one
    assert alloc.lookup([H[0]]) == x and alloc.lookup([H[1]]) == y
    assert alloc.allocate(1) == x  # the oldest cached page is evicted, its hash dropped
    assert alloc.lookup([H[0]]) == [] and alloc.lookup([H[1]]) == y
    alloc.share(y)  # a hit takes y out of the LRU list
    assert alloc.num_cached == 0 and alloc.num_free == 0
    with pytest.raises(CacheOutOfMemory, match="asked for 1 KV pages but only 0 of 3 are free"):
        alloc.allocate(1)
    alloc.check([[2], x, y])


def test_a_released_sequence_loses_its_deepest_page_first():
    alloc = PageAllocator(3)
    pages = alloc.allocate(3)
    for p, h in zip(pages, H, strict=False):
        alloc.register(p, h)
    alloc.free(pages)
    assert alloc.allocate(1) == [pages[2]]  # the prefix's root survives longest
    assert alloc.lookup(H[:3]) == pages[:2]


def test_share_and_register_refuse_pages_in_the_wrong_state():
    alloc = PageAllocator(2)
    with pytest.raises(EngineError, match="registered but no sequence holds it"):
        alloc.register(0, H[0])
    (p,) = alloc.allocate(1)
    with pytest.raises(EngineError, match="holds no registered prefix"):
        alloc.share([p])
    alloc.register(p, H[0])
    (q,) = alloc.allocate(1)
    alloc.register(q, H[0])  # the same content twice: the first page stays the one found
    assert alloc.lookup([H[0]]) == [p] and not alloc.is_registered(q)
    alloc.free([q])
    assert alloc.num_empty == 1 and alloc.num_cached == 0  # q was never registered


def test_the_checker_catches_a_leak_and_a_wrong_holder_count():
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    alloc.check([pages])
    with pytest.raises(EngineError, match="page .* has 1 references but 0 holders"):
        alloc.check([pages[:1]])  # a leaked page
    alloc._empty.append(pages[0])  # a page both referenced and free
    with pytest.raises(EngineError, match="two states"):
        alloc.check()


def test_reset_forgets_cached_prefixes_but_keeps_held_ones():
    alloc = PageAllocator(3)
    a, b = alloc.allocate(1), alloc.allocate(1)
    alloc.register(a[0], H[0])
    alloc.register(b[0], H[1])
    alloc.free(a)
    assert alloc.reset_prefix_cache() == 1
    assert alloc.lookup([H[0]]) == [] and alloc.lookup([H[1]]) == b and alloc.num_empty == 2
    alloc.check([b])


def test_random_workload_keeps_the_accounting():
    rng = random.Random(7)
    alloc = PageAllocator(12)
    tables: list[list[int]] = []
    names = [bytes([i]) * 32 for i in range(40)]
    for _ in range(600):
        op = rng.random()
        if op < 0.4 and alloc.num_free:
            hit = alloc.lookup(rng.sample(names, 3)[:1])
            alloc.share(hit)
            tables.append(hit + alloc.allocate(rng.randint(0, min(3, alloc.num_free))))
        elif op < 0.7 and tables:
            t = rng.choice(tables)
            if t:
                alloc.register(rng.choice(t), rng.choice(names))
        elif tables:
            alloc.free(tables.pop(rng.randrange(len(tables))))
        alloc.check(tables)
    for t in tables:
        alloc.free(t)
    alloc.check([])
    assert alloc.num_free == alloc.capacity


def test_the_hash_chain_names_a_page_by_its_whole_prefix():
    root = root_digest(cache_salt(kv_dtype="torch.bfloat16", page_size=4), False)
    page = [5, 6, 7, 8]
    after_a = chain_hash(chain_hash(root, [1, 2, 3, 4]), page)
    after_b = chain_hash(chain_hash(root, [1, 2, 3, 9]), page)
    assert after_a != after_b  # equal pages, different prefixes
    assert after_a == chain_hash(chain_hash(root, [1, 2, 3, 4]), page)
    fp8 = root_digest(cache_salt(kv_dtype="torch.float8_e4m3fn", page_size=4), False)
    assert chain_hash(fp8, [1, 2, 3, 4]) != chain_hash(root, [1, 2, 3, 4])
    long_rope = root_digest(cache_salt(kv_dtype="torch.bfloat16", page_size=4), True)
    assert chain_hash(long_rope, [1, 2, 3, 4]) != chain_hash(root, [1, 2, 3, 4])
    assert chain_hash(root, [256]) != chain_hash(root, [1, 0])  # ids are whole int64s, not bytes


def test_page_hashes_cover_output_tokens_and_grow_only():
    root = root_digest(b"salt", False)
    seq = Sequence(0, [1, 2, 3], SamplingParams())
    assert extend_page_hashes(seq, 1, 2, root) == [chain_hash(root, [1, 2])]
    seq.output_ids += [4, 5]
    hashes = extend_page_hashes(seq, 2, 2, root)
    assert hashes == [chain_hash(root, [1, 2]), chain_hash(chain_hash(root, [1, 2]), [3, 4])]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_enable_prefix_caching_must_be_a_bool(bad):
    with pytest.raises(InputError, match="enable_prefix_caching must be a bool"):
        EngineConfig(enable_prefix_caching=bad)
