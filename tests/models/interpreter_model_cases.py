"""The model's prefill through the generated Triton kernel, in Triton's interpreter on a CPU.

This checks the model-to-kernel contract (contiguity, dtypes, varlen batches, chunks with a
cached prefix) without a GPU. fp32: the interpreter computes bf16 dots wrongly. Run by
tests/models/test_model_triton_interpreter.py in a fresh process with TRITON_INTERPRET=1 set before
Triton is imported (or directly: TRITON_INTERPRET=1 pytest tests/models/interpreter_model_cases.py).
"""

from __future__ import annotations

import pytest
import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import ForwardBatch, random_model

pytestmark = pytest.mark.usefixtures("single_thread", "interpreter_env")


def test_engine_with_generated_prefill_kernel_matches_reference():
    triton_model = random_model("tiny", seed=4, attn_impl="triton")
    ref_model = random_model("tiny", seed=4, attn_impl="reference")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (90, 45)]
    ids = torch.tensor(sum(prompts, []))
    batch = ForwardBatch.whole_sequences([90, 45])
    got, want = triton_model(ids, batch), ref_model(ids, batch)
    torch.testing.assert_close(got[:, :261], want[:, :261], atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    fast = LLMEngine(triton_model, max_num_batched_tokens=40)  # chunks over a cached prefix
    slow = LLMEngine(ref_model)
    assert [r.token_ids for r in fast.generate(prompts, params)] == [
        r.token_ids for r in slow.generate(prompts, params)
    ]


# -- the fused elementwise kernels of the model's GPU path (sparsegen.kernels.fused) ---------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gegelu_matches_plain(dtype):
    from sparsegen.kernels.fused import gegelu as fused
    from sparsegen.models.phi3small import gegelu

    gen = torch.Generator().manual_seed(0)
    x = (30 * torch.randn(5, 2 * 700, generator=gen)).to(dtype)  # beyond +-limit; 3500 outputs: a masked tail
    got = fused.gegelu(x, 20.0)
    want = gegelu(x.float(), 20.0).to(dtype)  # the fused kernel computes in float32, rounds once
    assert got.shape == (5, 700) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_cache", [False, "token", "head"])  # no cache, or its page layout
@pytest.mark.parametrize("t", [7, 37])
@pytest.mark.parametrize("tiled", [False, True])  # a token per program; 16 (37 tokens: a masked tail)
def test_fused_rotary_qkv_matches_plain(dtype, with_cache, t, tiled, monkeypatch):
    from sparsegen.kernels.fused import rotary as fused
    from sparsegen.models.rope import Rotary

    if tiled:
        monkeypatch.setattr(fused, "ROTARY_TILED_FROM", 1)

    hkv, g, d, page = 2, 3, 16, 4
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, hkv * (g + 2) * d, generator=gen).to(dtype).view(t, hkv, g + 2, d)
    angles = torch.rand(t, d // 2, generator=gen) * 50
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    cache = slots = None
    if with_cache:
        pages = -(-t // page) + 1
        if with_cache == "token":  # [pages, page, Hkv, D]
            cache = tuple(torch.full((pages, page, hkv, d), float("nan"), dtype=dtype) for _ in range(2))
        else:  # the same view of [pages, Hkv, page, D] (runner.kv_cache's head-major pages)
            cache = tuple(
                torch.full((pages, hkv, page, d), float("nan"), dtype=dtype).transpose(1, 2) for _ in range(2)
            )
        slots = torch.randperm(pages * page, generator=gen)[:t]
    assert fused.supports_rotary(qkv)
    q, k, v = fused.rotary_qkv(qkv, cos, sin, cache, slots)
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(q, Rotary.apply(qkv[:, :, :g].reshape(t, hkv * g, d), cos, sin), **tol)
    torch.testing.assert_close(k, Rotary.apply(qkv[:, :, g], cos, sin), **tol)
    assert torch.equal(v, qkv[:, :, g + 1])
    if with_cache:
        kc, vc = (c.reshape(-1, hkv, d) for c in cache)  # [slots, Hkv, D]
        assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
        untouched = torch.ones(pages * page, dtype=torch.bool)
        untouched[slots] = False
        assert kc[untouched].isnan().all() and vc[untouched].isnan().all()


def test_fused_rotary_rejects_unlike_caches():
    from sparsegen.errors import InputError
    from sparsegen.kernels.fused import rotary as fused

    qkv = torch.zeros(3, 2, 5, 16)
    cos = sin = torch.zeros(3, 16)
    token = torch.zeros(4, 4, 2, 16)  # [pages, page, Hkv, D]
    head = torch.zeros(4, 2, 4, 16).transpose(1, 2)  # the same view, head-major
    slots = torch.arange(3)
    with pytest.raises(InputError, match="equal strides"):
        fused.rotary_qkv(qkv, cos, sin, (token, head), slots)
    with pytest.raises(InputError, match="contiguous last dim"):
        fused.rotary_qkv(qkv, cos, sin, (token[..., ::2], token[..., ::2]), slots)


def test_fused_rotary_declines_other_layouts():
    from sparsegen.kernels.fused import rotary as fused

    assert not fused.supports_rotary(torch.zeros(2, 1, 3, 96))  # head_dim not a power of two
    assert not fused.supports_rotary(torch.zeros(2, 1, 3, 64)[:, :, :, :32])  # not contiguous


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [256, 300])  # a power of two, and one with a masked tail
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_layer_norm_matches_plain(dtype, n, with_residual):
    from sparsegen.kernels.fused import add_norm as fused

    gen = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(5, n, generator=gen) + 1).to(dtype)
    res = (2 * torch.randn(5, n, generator=gen)).to(dtype) if with_residual else None
    norm = torch.nn.LayerNorm(n, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=gen)
        norm.bias.normal_(0.0, 0.1, generator=gen)
    y, r = fused.add_layer_norm(x, res, norm.weight, norm.bias, norm.eps)
    want_r = x + res if with_residual else x  # the plain add, rounded to dtype
    want_y = torch.nn.functional.layer_norm(
        want_r.float(), (n,), norm.weight.float(), norm.bias.float(), 1e-5
    )
    assert y.dtype == dtype and r.dtype == dtype and not y.isnan().any()
    assert torch.equal(r, want_r)
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, want_y.to(dtype), **tol)
