"""graph_capture.capture on the CPU: torch's CUDA capture is stood in for; what is checked is
the collector around it (dead cycles freed before the capture begins, no automatic collection
inside it, the collector's state restored after, also when the body raises). The GPU side is
tests/engine/test_graph_capture_gpu.py."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from sparsegen.runner.graph_capture import capture, gc_paused


class _Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_gc_paused_turns_the_collector_off_and_restores_it():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()


def test_capture_frees_dead_cycles_first_and_collects_nothing_inside(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def fake_graph(graph, **kwargs):
        entered.append((graph, kwargs, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    dead = _Cycle()
    dead_ref = weakref.ref(dead)
    del dead
    assert dead_ref() is not None  # a cycle outlives its last name
    saved = gc.get_threshold()
    try:
        with capture("g", pool=7, stream="s"):
            assert dead_ref() is None  # collected before the capture began
            gc.set_threshold(1)  # an automatic collection at almost every allocation, if enabled
            late = _Cycle()
            late_ref = weakref.ref(late)
            del late
            junk = [[i] for i in range(2000)]  # many container allocations
            assert late_ref() is not None and len(junk) == 2000  # nothing collected inside
    finally:
        gc.set_threshold(*saved)
    assert entered == [("g", {"pool": 7, "stream": "s"}, False)]
    assert gc.isenabled()
    gc.collect()
    assert late_ref() is None


def test_capture_restores_the_collector_when_the_body_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: contextlib.nullcontext())
    with pytest.raises(ValueError, match="body"), capture("g"):
        raise ValueError("body")
    assert gc.isenabled()
