"""`EngineStats`: how full an engine is now (its queue, its batch, its KV cache), for the server.

The HTTP server reads these for admission (`max_num_seqs`) and for `/metrics`, through
`LLM.stats()`. The scheduler and the page allocator are in the engine's process whatever runs the
model, so the numbers are always read there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    max_num_seqs: int  # sequences the running batch holds at once
    waiting: int  # sequences queued for a seat in the batch
    running: int  # sequences in the running batch
    kv_pages_used: int  # KV-cache pages held by sequences
    kv_pages_total: int  # usable KV-cache pages
    # prefix caching: pages no sequence holds whose K/V are kept for a later hit (free to evict),
    # and since the engine started, the tokens of sequences looked up at admission and the
    # tokens of those found in the cache (vLLM's prefix_cache_queries / prefix_cache_hits)
    kv_pages_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def engine_stats(engine) -> EngineStats:
    """An `LLMEngine`'s numbers, read now."""
    scheduler, alloc = engine.scheduler, engine.cache.allocator
    return EngineStats(
        max_num_seqs=scheduler.max_num_seqs,
        waiting=len(scheduler.waiting),
        running=len(scheduler.running),
        kv_pages_used=alloc.capacity - alloc.num_free,
        kv_pages_total=alloc.capacity,
        kv_pages_cached=alloc.num_cached,
        prefix_cache_queries=scheduler.prefix_counters.queries,
        prefix_cache_hits=scheduler.prefix_counters.hits,
    )
