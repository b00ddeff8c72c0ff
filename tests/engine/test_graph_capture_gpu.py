"""GPU tier for graph_capture.capture: a dead reference cycle that holds CUDA graphs (an old
engine's, say) can never be destroyed in the middle of another capture, which CUDA forbids.
`benchmarks/tools/gc_capture_hazard.py` runs the first case through plain torch.cuda.graph, to show
the failure this guards against."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import named_config, random_model
from sparsegen.runner.graph_capture import capture

pytestmark = pytest.mark.gpu


class _Holder:
    """Holds a captured graph in a reference cycle: only the cyclic collector frees it."""

    def __init__(self, x: torch.Tensor):
        self.me, self.graph = self, torch.cuda.CUDAGraph()
        with capture(self.graph):
            self.out = x * 3


def test_a_cycle_that_dies_inside_a_capture_is_not_collected_there():
    x = torch.randn(1 << 16, device="cuda")
    holder = _Holder(x)
    held = weakref.ref(holder)
    graph, saved = torch.cuda.CUDAGraph(), gc.get_threshold()
    try:
        with capture(graph):
            y = x * 2
            del holder  # unreachable from here on: a collection now would destroy its graph
            gc.set_threshold(1)  # an automatic collection at almost every allocation, if enabled
            junk = [[i] for i in range(5000)]
            y += 1
    finally:
        gc.set_threshold(*saved)
    assert len(junk) == 5000 and held() is not None
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2 + 1)
    gc.collect()
    assert held() is None  # freed once the capture had ended


def test_an_old_engines_graphs_in_a_dead_cycle_do_not_break_a_new_engines_capture():
    cfg = replace(named_config("tiny"), blocksparse_block_size=64)
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16, seed=3)
    prompts = [[(7 * i + j) % 200 for j in range(40 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    old = LLMEngine(model, kv_cache_bytes=256 << 20, use_cuda_graphs=True)
    want = [r.token_ids for r in old.generate(prompts, params)]
    assert old.graphs.graphs  # it captured decode graphs
    old.me = old  # a cycle, as a closure over the engine makes
    old_ref = weakref.ref(old)
    del old
    gc.disable()  # no automatic collection before the new engine's first capture
    try:
        new = LLMEngine(model, kv_cache_bytes=256 << 20, use_cuda_graphs=True)
        assert old_ref() is not None
        got = [r.token_ids for r in new.generate(prompts, params)]
    finally:
        gc.enable()
    assert old_ref() is None  # freed by the capture's collection, before the capture began
    assert got == want and new.graphs.graphs
