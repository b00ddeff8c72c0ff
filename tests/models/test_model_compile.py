"""The model under torch.compile(fullgraph=True) and torch.export, on the CPU tier.

Attention and the KV-cache write reach the graph as the registered ops (`sparsegen::prefill`,
`sparsegen::paged_decode`, `sparsegen_model::write_kv`); nothing breaks the graph, and the
compiled or exported forward equals eager. The `aot_eager` backend traces exactly what inductor
would get without generating code (the GPU tier compiles with inductor).
"""

from __future__ import annotations

import pytest
import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import ForwardBatch, random_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=0)


def op_names(graph) -> set[str]:
    """The ops a graph calls; a mutating custom op appears wrapped in auto_functionalized."""
    names = set()
    for n in graph.nodes:
        if n.op == "call_function":
            names.add(str(n.target))
            if "auto_functionalized" in str(n.target):
                names.add(str(n.args[0]))
    return names


class Recorder:
    """A torch.compile backend that keeps the ops of every graph and then runs aot_eager."""

    def __init__(self):
        self.targets: set[str] = set()
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def keep(graph, _inputs):
            self.targets |= op_names(graph.graph)
            return make_boxed_func(graph.forward)

        self.graphs += 1
        return aot_autograd(fw_compiler=keep)(gm, example_inputs)


def _decode_state(model):
    """An engine after prefilling two prompts, and the batch of its first decode step."""
    engine = LLMEngine(model, num_pages=24, page_size=8)
    engine.submit([[1, 2, 3, 4, 5] * 9, [7] * 20], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # prefill both
    plan = engine.scheduler.schedule()
    assert plan.is_decode
    ids, batch = engine.runner.prepare_decode(plan.chunks)
    return engine, ids, batch


@pytest.mark.slow
def test_fullgraph_compile_of_prefill_and_decode_equals_eager(model):
    torch._dynamo.reset()
    rec = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=rec)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1))
    batch = ForwardBatch.whole_sequences([45, 25])  # 45 > 2 blocks of 16: sparse layers differ from dense
    with torch.inference_mode():
        torch.testing.assert_close(compiled(ids, batch), model(ids, batch), rtol=1e-5, atol=1e-5)
    assert "sparsegen.prefill.default" in rec.targets

    engine, ids, batch = _decode_state(model)
    k_before = [k.clone() for k in engine.cache.k]
    with torch.inference_mode():
        got = compiled(ids, batch, engine.cache.layers)
        k_compiled = [k.clone() for k in engine.cache.k]
        for k, k0 in zip(engine.cache.k, k_before, strict=True):
            k.copy_(k0)
        want = model(ids, batch, engine.cache.layers)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(k_compiled, engine.cache.k, strict=True):  # the compiled step wrote the same keys
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(k_compiled, k_before, strict=True))
    assert {"sparsegen.paged_decode.default", "sparsegen_model.write_kv.default"} <= rec.targets


class PrefillForward(torch.nn.Module):
    """Whole-sequence prefill with tensor inputs only, for torch.export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, cu_seqlens):  # ids, positions: [T]; cu_seqlens: [B+1] int32
        batch = ForwardBatch(
            is_decode=False, positions=positions, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens
        )
        return self.model(ids, batch)


class DecodeForward(torch.nn.Module):
    """One decode step over the paged cache with tensor inputs only, for torch.export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, slots, block_tables, seq_lens, k_caches, v_caches):
        batch = ForwardBatch(
            is_decode=True,
            positions=positions,
            slot_mapping=slots,
            block_tables=block_tables,
            seq_lens=seq_lens,
        )
        return self.model(ids, batch, list(zip(k_caches, v_caches, strict=True)))


def test_export_of_prefill_and_decode_equals_eager(model):
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(2))
    batch = ForwardBatch.whole_sequences([50])
    args = (ids, batch.positions, batch.cu_seqlens_q)
    exported = torch.export.export(PrefillForward(model), args)
    targets = op_names(exported.graph)
    assert "sparsegen.prefill.default" in targets
    torch.testing.assert_close(exported.module()(*args), model(ids, batch), rtol=1e-5, atol=1e-5)

    engine, ids, batch = _decode_state(model)
    caches = (tuple(engine.cache.k), tuple(engine.cache.v))
    args = (ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens, *caches)
    exported = torch.export.export(DecodeForward(model), args)
    targets = op_names(exported.graph)
    assert {"sparsegen.paged_decode.default", "sparsegen_model.write_kv.default"} <= targets
    with torch.inference_mode():
        want = model(ids, batch, engine.cache.layers)
        got = exported.module()(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_engine_decode_equals_eager_as_the_batch_shrinks(model, monkeypatch):
    """compile_model=True: decode steps run the compiled forward (here through aot_eager, which
    traces what inductor would get) while the batch shrinks 3 -> 2 -> 1 and the block tables
    widen. fullgraph holds at every shape, dynamo compiles a few graphs (not one per step), and
    the greedy tokens equal an eager engine's."""
    from torch._dynamo.utils import counters

    from sparsegen.runner import model_runner

    monkeypatch.setattr(model_runner, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    prompts = [[1, 2, 3, 4, 5] * 9, [7] * 20, list(range(60))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 6, 12)]
    engine = LLMEngine(model, num_pages=40, page_size=8, compile_model=True)
    assert engine.runner.decode_forward is not model
    got = [r.token_ids for r in engine.generate(prompts, params)]
    want = [r.token_ids for r in LLMEngine(model, num_pages=40, page_size=8).generate(prompts, params)]
    assert got == want
    assert 2 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    assert not counters["graph_break"]


def test_set_force_dense_reaches_the_traced_ops(model):
    """The traced path hands the ops `layer_json`: switching to dense must change it too (the
    compiled forward would otherwise keep running the sparse spec)."""
    sparse = [b.self_attn.layer_json for b in model.model.layers]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(3))
    batch = ForwardBatch.whole_sequences([45])
    try:
        model.set_force_dense(True)
        assert all(b.self_attn.layer_json == s.to_json() for b, s in zip(model.model.layers, model.spec.layers,
                                                                          strict=True))  # fmt: skip
        assert [b.self_attn.layer_json for b in model.model.layers] != sparse
        with torch.inference_mode():
            dense_compiled, dense_eager = compiled(ids, batch), model(ids, batch)
        torch.testing.assert_close(dense_compiled, dense_eager, rtol=1e-5, atol=1e-5)
    finally:
        model.set_force_dense(False)
    assert [b.self_attn.layer_json for b in model.model.layers] == sparse
    with torch.inference_mode():
        sparse_eager = model(ids, batch)
        torch.testing.assert_close(compiled(ids, batch), sparse_eager, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dense_eager, sparse_eager, rtol=1e-3, atol=1e-3)  # 45 > 2 blocks: they differ
