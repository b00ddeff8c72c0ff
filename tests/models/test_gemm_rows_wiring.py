"""CPU tier: where the model hands its 2..32-row linears to `kernels.linear.gemm_rows`, and that it uses
what comes back correctly. The CUDA kernel itself is tested on the GPU (test_gemm_rows_gpu.py);
here a plain-PyTorch stand-in with the kernel's contract replaces it, `layers.rows_gemm` is told
to pick it on the CPU, and the engine's greedy tokens must equal the same model's without it.
The stand-in computes what the kernel's epilogues promise with the plain path's own functions,
so any mistake in the wiring (a wrong q layout, a missing K/V write, the wrong layer) changes
the tokens."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model
from sparsegen.models.kv_write import write_kv
from sparsegen.models.layers import gegelu
from sparsegen.models.rope import RopeWrite, Rotary

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _stand_in(calls: list):
    def gemm_rows(x, weight, bias=None, *, gegelu_limit=None, rope=None, **_):
        assert 2 <= x.shape[0] <= 32
        y = F.linear(x, weight, bias)
        if gegelu_limit is not None:
            calls.append("gegelu")
            return gegelu(y, gegelu_limit)
        if rope is None:
            calls.append("plain")
            return y
        calls.append("rope")
        assert isinstance(rope, RopeWrite)
        t = x.shape[0]
        hkv, d = rope.k_cache.shape[2], rope.k_cache.shape[3]
        qkv = y.view(t, hkv, rope.group + 2, d)
        q = Rotary.apply(qkv[:, :, : rope.group].reshape(t, -1, d), rope.cos, rope.sin)  # [T, H, D]
        k = Rotary.apply(qkv[:, :, rope.group], rope.cos, rope.sin)
        write_kv(rope.k_cache, rope.v_cache, rope.slot, k, qkv[:, :, rope.group + 1].contiguous())
        return q.reshape(t, -1)

    return gemm_rows


def test_model_routes_qkv_and_up_proj_through_gemm_rows(monkeypatch):
    model = random_model("tiny", seed=0)  # fused kernels on (not the reference model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    shapes = {tuple(attn.query_key_value.weight.shape), tuple(mlp.up_proj.weight.shape)}
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7]]
    want = [r.token_ids for r in LLMEngine(model, max_num_seqs=4).generate(prompts, GREEDY)]

    calls: list[str] = []

    def rows_gemm(layer, x, fused):
        return (
            fused
            and isinstance(layer, nn.Linear)
            and 2 <= x.shape[0] <= 32
            and tuple(layer.weight.shape) in shapes
        )

    monkeypatch.setattr("sparsegen.models.layers.ROWS_LAYERS", shapes)
    monkeypatch.setattr("sparsegen.kernels.linear.gemm_rows.gemm_rows", _stand_in(calls))
    monkeypatch.setattr("sparsegen.models.layers.rows_gemm", rows_gemm)
    monkeypatch.setattr("sparsegen.models.phi3small.rows_gemm", rows_gemm)
    monkeypatch.setattr("sparsegen.models.attention.rows_gemm", rows_gemm)
    got = [r.token_ids for r in LLMEngine(model, max_num_seqs=4).generate(prompts, GREEDY)]
    assert got == want
    # decode steps of 2..3 sequences: QKV with the rotary and cache write, up_proj with GeGeLU;
    # the prefill chunks of 3..7 tokens: QKV through the plain epilogue
    assert {"rope", "gegelu", "plain"} <= set(calls)
    assert calls.count("rope") == calls.count("gegelu") - calls.count("plain")
