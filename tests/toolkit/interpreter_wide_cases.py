"""Cases for tests/toolkit/test_wide_strategies.py, run in Triton's interpreter (a fresh process
with TRITON_INTERPRET=1): the prefill kernel on the wide regions the strategies now draw."""

from __future__ import annotations

from sparsegen import ops
from sparsegen.spec import HeadSpec, LayerSpec
from sparsegen.testing import PrefillProblem, assert_close_rows


def _layer(bs: int, kv: int, group: int) -> LayerSpec:
    head = HeadSpec(block_size=bs, local_blocks=2, vert_stride=3)
    return LayerSpec(num_heads=kv * group, num_kv_heads=kv, head_dim=64, heads=(head,) * (kv * group))


def test_the_interpreter_kernel_on_the_wide_region(interpreter_env, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")  # a row the kernel forgets to write is NaN
    cases = [
        PrefillProblem(_layer(16, 1, 2), [0, 5, 0], [0, 9, 4], seed=1),  # k_len 0 and q_len 0
        PrefillProblem(_layer(256, 8, 1), [5], [300], seed=2),  # block 256, 8 KV heads
        PrefillProblem(_layer(16, 1, 8), [20], [40], seed=3, scale=3.0),  # group 8, scores ~+-90
    ]
    for p in cases:
        assert_close_rows(ops.prefill(*p.args(), impl="triton"), p.reference(), context=p.repro())
