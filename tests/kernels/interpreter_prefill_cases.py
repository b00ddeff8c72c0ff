"""The generated Triton prefill kernel, run in Triton's interpreter, against the reference.

Run by tests/kernels/test_prefill_interpreter.py in a fresh process with TRITON_INTERPRET=1 set before
Triton is imported (or directly: TRITON_INTERPRET=1 pytest tests/kernels/interpreter_prefill_cases.py).
fp16 and fp32 only: the interpreter computes bf16 tl.dot wrongly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sparsegen
from sparsegen import HeadSpec, InputError, LayerSpec, ops
from sparsegen.testing import PrefillProblem, assert_close_rows, layer_specs, prefill_problems


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")  # NaN-filled outputs: unwritten rows fail
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")


def _check(problem: PrefillProblem) -> None:
    out = sparsegen.prefill(*problem.args(), impl="triton")
    assert_close_rows(out, problem.reference(), context=f"repro: {problem.repro()}")


def _phi3_like(num_heads=8, num_kv=2, bs=16, local=2, stride=4, head_dim=64) -> LayerSpec:
    heads = tuple(
        HeadSpec(block_size=bs, local_blocks=local, vert_stride=stride, vert_offset=h % stride)
        for h in range(num_heads)
    )
    return LayerSpec(num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, heads=heads)


SMALL_LAYERS = layer_specs(head_dims=(64,), max_kv_heads=2, gqa_ratios=(1, 2, 4, 8), block_sizes=(16, 32))


@settings(max_examples=40)
@given(prefill_problems(SMALL_LAYERS, max_batch=2, max_len=300, dtype=torch.float16))
@example(  # a window longer than the sequence, GQA 4, a cached prefix
    PrefillProblem(
        LayerSpec(4, 1, 64, (HeadSpec(block_size=32, sliding_window=400),) * 4), [50], [270], seed=3
    )
)
def test_fuzzed_specs_match_reference(problem):
    _check(problem)


@pytest.mark.parametrize(
    "q_lens,k_lens",
    [([193], [193]), ([1, 77], [129, 77]), ([64, 1, 250], [64, 33, 299])],
)
def test_phi3_like_layer(q_lens, k_lens):
    _check(PrefillProblem(_phi3_like(), q_lens, k_lens, seed=sum(k_lens)))


def test_hybrid_layer_head_dim_96_fp32():
    heads = (
        HeadSpec(block_size=32, sliding_window=40),
        HeadSpec(block_size=16, dense=True),
        HeadSpec(block_size=16, local_blocks=1, vert_stride=3, vert_offset=1, sliding_window=20),
        HeadSpec(block_size=64, vert_stride=2, sliding_window=7),
    )
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=96, heads=heads)
    _check(PrefillProblem(layer, [90, 33], [130, 33], seed=2, dtype=torch.float32))


@given(st.integers(1, 8).map(lambda g: 8 // g if 8 % g == 0 else 1))
@settings(max_examples=4)
def test_gqa_ratios(num_kv):
    layer = _phi3_like(num_heads=8, num_kv=num_kv, bs=32, local=1, stride=3)
    _check(PrefillProblem(layer, [97], [161], seed=num_kv))


def test_dense_equals_causal_sdpa():
    layer = LayerSpec(4, 2, 64, (HeadSpec(dense=True),) * 4)
    p = PrefillProblem(layer, [150], [150], seed=5, dtype=torch.float32)
    out = sparsegen.prefill(*p.args(), impl="triton")
    q, k, v = (p.tensors[n].transpose(0, 1).double() for n in "qkv")
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
    assert_close_rows(out, ref)


def test_bad_inputs_raise_before_launch():
    layer = _phi3_like(num_heads=4, num_kv=2)
    p = PrefillProblem(layer, [20], [20], seed=0)
    q, k, v, cu_q, cu_k, _, _ = p.args()
    with pytest.raises(InputError, match="cu_seqlens_q"):
        sparsegen.prefill(q, k, v, cu_q.long(), cu_k, layer, impl="triton")
    with pytest.raises(InputError, match="stride 1"):
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)
        sparsegen.prefill(qt, k, v, cu_q, cu_k, layer, impl="triton")
    with pytest.raises(InputError, match="q_len"):
        sparsegen.prefill(
            q, k[:10], v[:10], cu_q, torch.tensor([0, 10], dtype=torch.int32), layer, impl="triton"
        )


def test_value_check_runs_after_prepare_and_before_the_launch(monkeypatch):
    """The host read of cu_seqlens (the one device sync) comes last, right before the launch, so
    the GPU idles only for the launch; a bad value still stops everything before it runs."""
    from sparsegen.kernels import prefill as prefill_mod

    layer = _phi3_like(num_heads=4, num_kv=2)
    p = PrefillProblem(layer, [20], [20], seed=1)
    q, k, v, cu_q, cu_k, _, _ = p.args()
    events = []
    real_prepare, real_call = prefill_mod.PrefillKernel.prepare, prefill_mod.Launch.__call__
    real_values = ops.check_cu_seqlens_values

    def prepare(self, *a, **kw):
        events.append("prepare")
        return real_prepare(self, *a, **kw)

    def values(*a, **kw):
        events.append("values")
        return real_values(*a, **kw)

    def call(self):
        events.append("launch")
        return real_call(self)

    monkeypatch.setattr(prefill_mod.PrefillKernel, "prepare", prepare)
    monkeypatch.setattr(prefill_mod.Launch, "__call__", call)
    monkeypatch.setattr(ops, "check_cu_seqlens_values", values)
    out = sparsegen.prefill(q, k, v, cu_q, cu_k, layer, impl="triton")
    assert events == ["prepare", "values", "launch"]
    assert not torch.isnan(out).any()
    events.clear()
    bad = torch.tensor([0, 21], dtype=torch.int32)  # ends past the 20 tokens of q
    with pytest.raises(InputError, match=r"cu_seqlens_q\[-1\] is 21"):
        sparsegen.prefill(q, k, v, bad, cu_k, layer, impl="triton")
    assert events == ["prepare", "values"]  # refused: nothing launched
    events.clear()
    sparsegen.prefill(q, k, v, cu_q, cu_k, layer, impl="triton", max_seqlen_q=20, max_seqlen_k=20)
    assert events == ["prepare", "launch"]  # max_seqlen given: no host read at all


@pytest.mark.parametrize("tiles", [(128, 64), (64, 32)])
@given(problem=prefill_problems(layer_specs(head_dims=(64,), max_kv_heads=1, gqa_ratios=(1, 2)), max_batch=2))
@settings(max_examples=8)
def test_gpu_tile_sizes(tiles, problem):
    """The GPU tiling (BLOCK_M spanning several sparse blocks, or a part of one) in the interpreter."""
    from sparsegen.kernels import prefill as prefill_mod
    from sparsegen.kernels import prefill_template

    config = {"block_m": tiles[0], "block_n": tiles[1], "num_warps": 4, "num_stages": 1}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill_template, "pick_config", lambda *a: config)
        prefill_mod.forget()
        try:
            _check(problem)
        finally:
            prefill_mod.forget()
