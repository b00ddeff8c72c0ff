"""The random-weight presets of real sizes (`--random mistral-7b`, ...): read as transformers
reads the same fields, their parameter counts those of the published models, their windows per
layer, and random weights for a decoder family drawn finite and non-zero."""

from __future__ import annotations

import pytest
import torch
from helpers.extras import require

from sparsegen.commands.options import RANDOM_CHOICES
from sparsegen.errors import CheckpointError
from sparsegen.llm.build import RANDOM_SIZES
from sparsegen.models import ForwardBatch, random_model
from sparsegen.models.families import PRESETS, RANDOM_NAMES, config_from_dict, random_config

# published parameter counts (billions), lm_head untied (random models untie it)
PARAMS = {"mistral-7b": 7.24, "llama3-8b": 8.03, "qwen2-7b": 7.62, "gemma2-9b": 10.16, "gpt-oss-20b": 20.91}
WINDOWS = {
    "mistral-7b": {4096},
    "llama3-8b": {0},
    "qwen2-7b": {0},
    "gemma2-9b": {4096, 0},
    "gpt-oss-20b": {128, 0},
}


def test_names_agree_everywhere():
    assert RANDOM_CHOICES == RANDOM_NAMES == RANDOM_SIZES
    assert set(PRESETS) == set(PARAMS) and RANDOM_NAMES[:2] == ("tiny", "7b")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_sizes_and_windows(name):
    cfg = random_config(name)
    assert cfg.parameter_count() / 1e9 == pytest.approx(PARAMS[name], abs=0.02)
    spec = cfg.attention_spec()
    assert len(spec.layers) == cfg.num_hidden_layers
    assert {layer.heads[0].sliding_window for layer in spec.layers} == WINDOWS[name]
    if name in ("gemma2-9b", "gpt-oss-20b"):  # windowed on even layers
        assert [layer.heads[0].sliding_window > 0 for layer in spec.layers[:2]] == [True, False]
    assert all(layer.learned_sinks == (name == "gpt-oss-20b") for layer in spec.layers)
    assert all(layer.logit_softcap == (50.0 if name == "gemma2-9b" else 0.0) for layer in spec.layers)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_read_as_transformers_reads_them(name):
    transformers = require("transformers")
    ours = random_config(name)
    theirs = transformers.AutoConfig.for_model(**PRESETS[name])
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps"):  # fmt: skip
        assert getattr(ours, key) == getattr(theirs, key), key


def test_unknown_name_is_refused():
    with pytest.raises(CheckpointError, match="unknown model size 'mistral-70b'"):
        random_config("mistral-70b")


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "gpt_oss"])
def test_random_weights_of_a_family_are_finite_and_drawn(model_type):
    cfg = config_from_dict(dict(model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                num_local_experts=4, num_experts_per_tok=2, sliding_window=4))  # fmt: skip
    model = random_model(cfg, seed=1)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and p.abs().sum() > 0, name
    logits = model(torch.arange(12), ForwardBatch.whole_sequences([12]))
    assert logits.shape == (12, 64) and torch.isfinite(logits).all()


def test_experts_without_host_reads_equal_the_routed_loop(monkeypatch):
    """The every-expert path (CUDA-graph capture, torch.compile) gives the routed loop's output."""
    cfg = config_from_dict(dict(model_type="gpt_oss", vocab_size=64, hidden_size=64, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.5))  # fmt: skip
    moe = random_model(cfg, seed=2).model.layers[0].mlp
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    routed = moe(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(moe(x), routed, rtol=1e-5, atol=1e-6)
