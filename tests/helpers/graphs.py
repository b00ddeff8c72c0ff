"""A CPU stand-in for the engine's CUDA decode graphs: the same static buffers, width buckets
and host tables, with each capture replaced by a call that reruns on those buffers."""

from __future__ import annotations

from sparsegen.engine import LLMEngine
from sparsegen.runner.cuda_graphs import DecodeGraphs


class _EagerGraph:
    """Stands in for a CUDA graph on CPU: replay() reruns the captured call on the static buffers."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        self.out.copy_(self.fn())


def stand_in_graphs(model, engine: LLMEngine, max_seqs: int) -> DecodeGraphs:
    """DecodeGraphs for `engine` whose captures are `_EagerGraph`s (static buffers, width buckets
    and host tables as on a GPU), installed as the engine's graphs."""
    graphs = DecodeGraphs(model, engine.cache, max_seqs, engine.max_model_len)

    def capture(b, w):
        batch = graphs._batch(b, w)
        graph = _EagerGraph(lambda: model(graphs.ids[:b], batch, engine.cache.layers))
        return graph, graph.out

    graphs._capture = capture
    engine.runner.graphs = graphs
    return graphs
