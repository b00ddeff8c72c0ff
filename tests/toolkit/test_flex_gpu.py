"""GPU tier: FlexAttention, compiled with torch.compile and fed sparsegen.flex's block mask, agrees
with sparsegen's own prefill kernel and the reference (this is the configuration `sparsegen bench`
times FlexAttention in)."""

from __future__ import annotations

import pytest
import torch

import sparsegen as sg
from sparsegen import flex
from sparsegen.testing import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("n_q", "n_k"), [(2148, 2148), (1, 5000), (300, 3001)])
def test_compiled_flex_attention_equals_sparsegen(n_q, n_k):
    from torch.nn.attention.flex_attention import flex_attention

    layer = sg.get_pattern("phi3small").layers[0]
    gen = torch.Generator(device="cuda").manual_seed(n_k)
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.randn(n_q, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # [T, H, D]
    k = torch.randn(n_k, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n_k, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.tensor([0, n_q], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, n_k], dtype=torch.int32, device="cuda")
    ref = sg.reference.prefill(q.float(), k.float(), v.float(), cu_q, cu_k, layer, scale=0.1)
    ours = sg.prefill(q, k, v, cu_q, cu_k, layer, scale=0.1)
    bm = flex.block_mask(layer, n_q, n_k, device="cuda", compile=True)
    theirs = torch.compile(flex_attention)(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        block_mask=bm, scale=0.1, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    assert rel_err(ours, ref) < 2e-2
    assert rel_err(theirs, ref) < 2e-2
    assert rel_err(theirs, ours) < 3e-2
