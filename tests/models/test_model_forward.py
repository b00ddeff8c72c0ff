"""The model's forward against a plain float64 re-derivation from the raw checkpoint tensors.

The re-derivation spells out DESIGN §2 directly (μP multipliers, fused QKV viewed as
(T, Hkv, G + 2, D), NeoX rotary, LayerNorm with bias, GeGeLU on interleaved halves with
limit 20, logits ÷ 8, dummy tokens at the minimum) and masks with `sparsegen.visible_mask`.
"""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoint import TINY_HF_CONFIG, random_tensors, write_checkpoint

from sparsegen import visible_mask
from sparsegen.models import ForwardBatch, gegelu, load_checkpoint, random_model

CFG = TINY_HF_CONFIG

pytestmark = pytest.mark.usefixtures("single_thread")


def naive_logits(t: dict[str, torch.Tensor], ids: torch.Tensor, force_dense: bool = False) -> torch.Tensor:
    from sparsegen.models import Phi3SmallConfig, model_spec

    spec = model_spec(Phi3SmallConfig.from_hf_dict(CFG), force_dense)
    w = {k: v.double() for k, v in t.items()}
    n, hid, heads, kvh = len(ids), CFG["hidden_size"], CFG["num_attention_heads"], CFG["num_key_value_heads"]
    d, g = hid // heads, heads // kvh
    x = w["model.embed_tokens.weight"][ids] * 10.0
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()  # [T, D/2]

    def rope(u):  # u: [T, heads, D]; pairs (i, i + D/2)
        a, b = u[..., : d // 2], u[..., d // 2 :]
        c, s = cos[:, None], sin[:, None]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1)

    def ln(u, name):
        return torch.nn.functional.layer_norm(u, (hid,), w[name + ".weight"], w[name + ".bias"], 1e-5)

    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = ln(x, p + "input_layernorm")
        qkv = h @ w[p + "self_attn.query_key_value.weight"].T + w[p + "self_attn.query_key_value.bias"]
        qkv = qkv.view(n, kvh, g + 2, d)
        q, k, v = rope(qkv[:, :, :g].reshape(n, heads, d)), rope(qkv[:, :, g]), qkv[:, :, g + 1]
        k, v = k[:, torch.arange(heads) // g], v[:, torch.arange(heads) // g]  # [T, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) / d  # μP: 1/d, not 1/sqrt(d)
        scores = scores.masked_fill(~visible_mask(spec.layers[i], n), float("-inf"))
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hid)
        x = x + att @ w[p + "self_attn.dense.weight"].T + w[p + "self_attn.dense.bias"]
        h = ln(x, p + "post_attention_layernorm")
        up = h @ w[p + "mlp.up_proj.weight"].T + w[p + "mlp.up_proj.bias"]
        gate, lin = up[:, 0::2].clamp(max=20), up[:, 1::2].clamp(-20, 20)
        act = gate * torch.sigmoid(1.702 * gate) * (lin + 1)
        x = x + act @ w[p + "mlp.down_proj.weight"].T + w[p + "mlp.down_proj.bias"]
    x = ln(x, "model.final_layernorm")
    return x @ w["model.embed_tokens.weight"].T / 8.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = random_tensors(CFG, seed=11)
    return write_checkpoint(tmp_path_factory.mktemp("fwd"), tensors=tensors), tensors


def test_forward_matches_plain_derivation(checkpoint):
    folder, tensors = checkpoint
    model = load_checkpoint(folder, dtype=torch.float32, attn_impl="reference")
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0))
    got = model(ids, ForwardBatch.whole_sequences([150]))
    want = naive_logits(tensors, ids)
    dummies = CFG["dummy_token_indices"]
    assert torch.all(got[:, dummies] == torch.finfo(torch.float32).min)
    keep = [i for i in range(CFG["vocab_size"]) if i not in dummies]
    torch.testing.assert_close(got[:, keep].double(), want[:, keep], atol=2e-4, rtol=1e-4)


def test_sparse_layers_change_logits_only_past_the_local_span(checkpoint):
    folder, _ = checkpoint
    sparse = load_checkpoint(folder, dtype=torch.float32)
    dense = load_checkpoint(folder, dtype=torch.float32, force_dense=True)
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    batch = ForwardBatch.whole_sequences([200])
    a, b = sparse(ids, batch), dense(ids, batch)
    # 2 local blocks of 16: every head sees all keys of the first 32 positions
    torch.testing.assert_close(a[:32], b[:32])
    assert (a[100:] - b[100:]).abs().max() > 1e-2


def test_gegelu_interleaves_and_clamps():
    x = torch.tensor([[30.0, -30.0, 1.0, 2.0]])  # (gate, linear) pairs: (30, -30), (1, 2)
    out = gegelu(x, 20.0)
    g = torch.tensor([20.0, 1.0])
    want = g * torch.sigmoid(1.702 * g) * torch.tensor([-20.0 + 1, 2.0 + 1])
    torch.testing.assert_close(out[0], want)


def test_batched_prefill_equals_separate_sequences():
    model = random_model("tiny", seed=2)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 256, (70,), generator=gen), torch.randint(0, 256, (45,), generator=gen)
    both = model(torch.cat([a, b]), ForwardBatch.whole_sequences([70, 45]))
    torch.testing.assert_close(both[:70], model(a, ForwardBatch.whole_sequences([70])), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[70:], model(b, ForwardBatch.whole_sequences([45])), atol=1e-5, rtol=1e-5)


def test_in_major_weights_hold_the_same_values_as_row_major():
    """down_proj and lm_head are stored [in, out] (seen as [out, in]) unless the model is built for
    the Triton GEMV; the same seed fills both builds with the same numbers, in logical order, and
    both give the same logits."""
    a = random_model("tiny", seed=3)  # in-major down_proj / lm_head
    b = random_model("tiny", seed=3, triton_gemv=True)  # every weight [out, in]
    for m, col in ((a, True), (b, False)):
        w = m.model.layers[0].mlp.down_proj.weight  # [out, in]
        assert (w.stride() == (1, w.shape[0])) is col and (m.lm_head.weight.stride(0) == 1) is col
        assert m.model.layers[0].self_attn.query_key_value.weight.is_contiguous()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    batch = ForwardBatch.whole_sequences([40])
    with torch.inference_mode():
        torch.testing.assert_close(a(ids, batch), b(ids, batch), rtol=1e-5, atol=1e-5)


def test_checkpoint_loads_into_in_major_weights(checkpoint):
    folder, tensors = checkpoint
    model = load_checkpoint(folder, dtype=torch.float32)
    w = model.model.layers[0].mlp.down_proj.weight
    assert w.stride(0) == 1 and torch.equal(w, tensors["model.layers.0.mlp.down_proj.weight"].float())
