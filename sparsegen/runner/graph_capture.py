"""CUDA-graph capture that Python's garbage collector cannot break: the one way sparsegen (the
engine, the benchmarks, the GPU tests) captures a graph.

While a stream captures, CUDA forbids destroying a graph or its executable: the call fails and
invalidates the capture in progress. Python frees objects held in reference cycles only when its
cyclic collector runs, and an automatic collection can start at any allocation of a container,
including the many that a capture's Python code makes. torch.cuda.graph no longer collects before
it begins (torch.compiler.config.force_cudagraph_gc is off by default), so an unreachable cycle
holding an old engine's graphs (an engine caught in a closure, say) could be freed mid-capture,
which fails the capture with "CUDAGraph reset: operation not permitted when stream is capturing"
(benchmarks/gc_capture_hazard.py shows it with plain torch.cuda.graph).

`capture` collects once before the capture begins, where destroying graphs is allowed, and keeps
the automatic collector off until the capture has ended.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's automatic cyclic collection off for the block, back as it was after it (an
    explicit gc.collect() still runs)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, **graph_kwargs) -> Iterator[None]:
    """`with capture(graph, pool=..., stream=...):` is torch.cuda.graph(graph, **graph_kwargs)
    after one full collection, with no automatic collection until the capture has ended."""
    gc.collect()
    with gc_paused(), torch.cuda.graph(graph, **graph_kwargs):
        yield
