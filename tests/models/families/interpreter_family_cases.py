"""The decoder families' fused kernels in Triton's interpreter on a CPU: the add + RMSNorm kernel
(Llama's rounding and Gemma's 1 + w) against `models.layers.RMSNorm`, the GEMV with an RMSNorm
before it and SwiGLU / GeGLU after it against the plain ops, and each family's batch-1 path
(`triton_gemv=True`: QKV, gate_up, o_proj, down_proj and lm_head through the GEMV, the norms and
at a decode step the rotary and K/V write inside) against the plain model, logits and greedy
tokens. fp32 / fp16 (the interpreter computes no bf16). Run by test_family_interpreter.py in a
fresh process with TRITON_INTERPRET=1 set before Triton is imported.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsegen.errors import InputError

pytestmark = pytest.mark.usefixtures("single_thread", "interpreter_env")


def _interp():
    from sparsegen import ops

    assert ops.interpreter_usable(), "TRITON_INTERPRET=1 must be set before Triton is imported"


def _norm(n, offset, dtype, gen):
    from sparsegen.models.layers import RMSNorm

    norm = RMSNorm(n, 1e-5, {"dtype": dtype}, offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=gen) * 0.3 + (0.0 if offset else 1.0))
    return norm


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [256, 300])  # a power of two, and a masked tail
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_rmsnorm(dtype, n, offset, with_residual):
    from sparsegen.kernels.fused import add_norm as fused

    _interp()
    gen = torch.Generator().manual_seed(n + int(offset))
    x = (3 * torch.randn(5, n, generator=gen) + 1).to(dtype)
    res = (2 * torch.randn(5, n, generator=gen)).to(dtype) if with_residual else None
    norm = _norm(n, offset, dtype, gen)
    y, r = fused.add_layer_norm(x, res, norm.weight, None, norm.eps, kind=norm.kind)
    want_r = x + res if with_residual else x
    assert torch.equal(r, want_r) and y.dtype == dtype and torch.isfinite(y).all()
    with torch.no_grad():
        torch.testing.assert_close(y, norm(want_r), **TOL[dtype])


def test_add_rms_norm_refuses_a_bias_and_unknown_kinds():
    from sparsegen.kernels.fused import add_norm as fused

    x, w = torch.ones(2, 8), torch.ones(8)
    with pytest.raises(InputError, match="no bias"):
        fused.add_layer_norm(x, None, w, w, 1e-5, kind="rms")
    with pytest.raises(InputError, match="a bias"):
        fused.add_layer_norm(x, None, w, None, 1e-5)
    with pytest.raises(InputError, match="kind must be one of"):
        fused.add_layer_norm(x, None, w, None, 1e-5, kind="rms2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("glu", [None, "silu", "gelu_tanh"])
@pytest.mark.parametrize("n,k", [(64, 96), (130, 200)])
def test_gemv_with_rms_norm_and_glu_equals_the_plain_ops(dtype, offset, glu, n, k):
    from sparsegen.kernels.linear import gemv

    _interp()
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    res = torch.randn(1, k, generator=gen).to(dtype)
    w = (4 * torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    norm = _norm(k, offset, dtype, gen)
    kind = norm.kind
    got, summed = gemv.gemv(x, w, b, glu=glu, norm=(res, norm.weight, None, norm.eps), norm_kind=kind)
    with torch.no_grad():
        y = F.linear(norm(x + res), w, b)
        if glu is not None:
            gate, up = y[:, 0::2], y[:, 1::2]
            y = (F.silu(gate) if glu == "silu" else F.gelu(gate, approximate="tanh")) * up
    assert torch.equal(summed, x + res) and got.shape == y.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, y, **({"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else
                                          {"rtol": 1e-2, "atol": 1e-2}))  # fmt: skip


def test_gemv_refuses_bad_glu_and_norm_kinds():
    from sparsegen.kernels.linear import gemv

    x, w, ln = torch.ones(1, 8), torch.ones(6, 8), torch.ones(8)
    with pytest.raises(InputError, match="glu must be one of"):
        gemv.gemv(x, w, glu="relu")
    with pytest.raises(InputError, match="glu or rope, one at most"):
        gemv.gemv(x, w, glu="silu", gegelu_limit=3.0)
    with pytest.raises(InputError, match="even number"):
        gemv.gemv(x, torch.ones(5, 8), glu="silu")
    with pytest.raises(InputError, match="norm_kind must be one of"):
        gemv.gemv(x, w, norm=(None, ln, None, 1e-5), norm_kind="rms3")
    with pytest.raises(InputError, match="an RMSNorm's weight only"):
        gemv.gemv(x, w, norm=(None, ln, ln, 1e-5), norm_kind="rms")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_family_batch1_path_through_the_gemv_matches_the_plain_model(tmp_path, family):
    """llama: the rotary in the QKV GEMV; qwen3: q/k norms, so the rotary outside it; gemma2:
    Gemma's 1 + w norms, sandwich norms, GeGLU; gpt_oss: experts after the add + norm, sinks."""
    from helpers.extras import require
    from helpers.hf_families import write_family_checkpoint

    import sparsegen.kernels.linear.gemv as gm
    from sparsegen.engine import LLMEngine, SamplingParams
    from sparsegen.models import ForwardBatch, load_checkpoint

    require("transformers")
    _interp()
    folder, _ = write_family_checkpoint(tmp_path / "ckpt", family)
    fast = load_checkpoint(folder, dtype=torch.float32, triton_gemv=True)
    plain = load_checkpoint(folder, dtype=torch.float32)
    calls = []
    real = gm.gemv
    gm.gemv = lambda *a, **kw: calls.append((kw.get("glu"), kw.get("rope") is not None)) or real(*a, **kw)
    try:
        ids, batch = torch.tensor([5]), ForwardBatch.whole_sequences([1])
        got = fast(ids, batch)
        layers = fast.config.num_hidden_layers
        dense_mlp = not fast.config.num_experts
        assert len(calls) == layers * (2 + 2 * dense_mlp) + 1  # qkv, o, (gate_up, down), lm_head
        assert sum(glu == fast.config.act for glu, _ in calls) == layers * dense_mlp
        torch.testing.assert_close(got, plain(ids, batch), rtol=1e-5, atol=1e-5)
        prompt = [(7 * i + 3) % 90 + 1 for i in range(20)]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        calls.clear()
        got_ids = LLMEngine(fast).generate([prompt], params)[0].token_ids
    finally:
        gm.gemv = real
    assert got_ids == LLMEngine(plain).generate([prompt], params)[0].token_ids
    # the two decode steps' QKV GEMVs rotated and wrote the cache, unless q and k are normed first
    assert sum(rope for _, rope in calls) == (0 if fast.config.qk_norm else 2 * layers)
