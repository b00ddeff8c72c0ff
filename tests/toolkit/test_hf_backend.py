"""`attn_implementation="sparsegen"` inside transformers' own models, against "eager" on tiny
random checkpoints whose windows bite inside the prompt (CPU, float32, the reference)."""

from __future__ import annotations

import pytest
import torch
from helpers import extras
from helpers.hf_models import SMALL, write_tiny_checkpoints

from sparsegen.errors import InputError

transformers = extras.require("transformers")
from sparsegen import hf  # noqa: E402 - needs transformers, the [hf] extra

PROMPT = 20  # longer than every window of the tiny checkpoints
pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one intra-op thread


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("hf-backend"))


def _pair(path):
    load = transformers.AutoModelForCausalLM.from_pretrained
    return (load(str(path), attn_implementation="eager", dtype=torch.float32).eval(),
            load(str(path), attn_implementation="sparsegen", dtype=torch.float32).eval())  # fmt: skip


def _spy(monkeypatch):
    calls = []
    real = hf.prefill

    def spy(q, k, v, cu_q, cu_k, layer, *args, **kwargs):
        calls.append((layer, q.shape[0], k.shape[0]))
        return real(q, k, v, cu_q, cu_k, layer, *args, **kwargs)

    monkeypatch.setattr(hf, "prefill", spy)
    return calls


@pytest.mark.parametrize("name", ["mistral", "qwen2", "llama", "gemma2", "gpt_oss"])
def test_logits_and_greedy_tokens_match_eager(checkpoints, name, monkeypatch):
    calls = _spy(monkeypatch)
    eager, ours = _pair(checkpoints[name])
    torch.manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, PROMPT))
    with torch.no_grad():
        want, got = eager(ids).logits, ours(ids).logits
    assert calls, "the sparsegen backend was never called"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    want = eager.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    got = ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    decode = [c for c in calls if c[1] == 2]  # one query per row: decode through transformers' cache
    assert decode and all(k_len > q_len for _, q_len, k_len in decode)


def test_each_layer_reads_its_own_window_cap_and_sinks(checkpoints, monkeypatch):
    calls = _spy(monkeypatch)
    ids = torch.randint(0, SMALL["vocab_size"], (1, PROMPT))
    seen = {}
    for name in ("qwen2", "gemma2", "gpt_oss"):
        calls.clear()
        _, ours = _pair(checkpoints[name])
        with torch.no_grad():
            ours(ids)
        seen[name] = [(c[0].heads[0].sliding_window, c[0].logit_softcap, c[0].learned_sinks) for c in calls]
    assert seen["qwen2"] == [(0, 0.0, False), (6, 0.0, False), (6, 0.0, False)]  # max_window_layers=1
    assert seen["gemma2"] == [(8, 5.0, False), (0, 5.0, False)]  # sliding, full
    assert seen["gpt_oss"] == [(8, 0.0, True), (0, 0.0, True)]
    assert hf.layer_spec(2, 1, 32, 8, 0.0, False) is hf.layer_spec(2, 1, 32, 8, 0.0, False)


def _no_window(model):
    model.config.sliding_window = None


def _no_softcap(model):
    model.config.attn_logit_softcapping = None  # the backend's fallback when a module passes none
    for module in model.modules():
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None


def _zero_sinks(model):
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.zeros_(module.sinks)


@pytest.mark.parametrize(
    ("name", "change"), [("mistral", _no_window), ("gemma2", _no_softcap), ("gpt_oss", _zero_sinks)]
)
def test_each_feature_changes_the_answer(checkpoints, name, change):
    """Dropping the window, the soft-cap or the sinks moves the logits: the comparisons above can fail."""
    eager, ours = _pair(checkpoints[name])
    ids = torch.randint(0, SMALL["vocab_size"], (1, PROMPT))
    change(ours)
    with torch.no_grad():
        assert (eager(ids).logits - ours(ids).logits).abs().max() > 1e-3


def test_left_padding_is_refused_with_a_clear_error(checkpoints):
    _, ours = _pair(checkpoints["mistral"])
    ids = torch.randint(3, SMALL["vocab_size"], (2, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with pytest.raises(InputError, match="unpadded batches"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_check_mask_boundaries():
    causal = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2)[
        None, None
    ]  # queries are the last 4 of 6 keys
    hf.check_mask(causal, 1, 4, 6, 0)
    hf.check_mask(None, 1, 4, 6, 3)
    windowed = causal & ~torch.ones(4, 6, dtype=torch.bool).tril(diagonal=-1)[None, None]
    hf.check_mask(windowed, 1, 4, 6, 3)
    additive = torch.zeros(1, 1, 4, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    hf.check_mask(additive, 1, 4, 6, 0)
    for bad, window in ((windowed, 0), (causal, 3), (causal[..., :5], 0)):
        with pytest.raises(InputError, match="unpadded"):
            hf.check_mask(bad, 1, 4, 6, window)
    with pytest.raises(InputError, match="4D mask"):
        hf.check_mask(causal[0], 1, 4, 6, 0)


def test_training_features_and_bad_windows_are_refused():
    class Module(torch.nn.Module):
        sliding_window = None

    q, k = torch.randn(1, 2, 4, 32), torch.randn(1, 1, 4, 32)
    module = Module().train()
    with pytest.raises(InputError, match="dropout"):
        hf.sparsegen_attention(module, q, k, k, None, dropout=0.1)
    with pytest.raises(InputError, match="output_attentions"):
        hf.sparsegen_attention(module.eval(), q, k, k, None, output_attentions=True)
    for w in (-1, 2.5, True):
        with pytest.raises(InputError, match="sliding window"):
            hf.sparsegen_attention(module, q, k, k, None, sliding_window=w)
    with pytest.raises(InputError, match="do not agree"):
        hf.sparsegen_attention(module, q, k, k[:, :, :3], None)
    out, weights = hf.sparsegen_attention(module, q, k, k, None, scaling=0.5)
    assert out.shape == (1, 4, 2, 32) and weights is None
