"""HF configs mapped per layer with their attention features (soft-cap, learned sinks, scale,
head_dim), compared with transformers' own config classes; what cannot be honoured is refused."""

from __future__ import annotations

import json

import pytest
from helpers import extras
from helpers.hf_configs import GEMMA2_9B, GEMMA2_27B, GPT_OSS_20B, MISTRAL_7B_V01, QWEN3_8B

from sparsegen.errors import SpecError
from sparsegen.hf_config import model_spec_from_hf

SHAPE = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2}
N = 6
CLASSES = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "gpt_oss": "GptOssConfig",
           "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen3": "Qwen3Config"}  # fmt: skip
FILES = [
    ("gemma2", {}),
    ("gemma2", {"attn_logit_softcapping": None, "query_pre_attn_scalar": 144, "head_dim": 64}),
    ("gemma2", {"attn_logit_softcapping": 30.0, "head_dim": 128}),
    ("gemma3_text", {}),
    ("gemma3_text", {"attn_logit_softcapping": 20.0, "query_pre_attn_scalar": 168, "head_dim": 160}),
    ("gpt_oss", {"head_dim": 64}),
    ("llama", {}),
    ("mistral", {}),
    ("qwen3", {"head_dim": 128}),
]


def _features(spec) -> set[tuple]:
    return {(ly.head_dim, ly.logit_softcap, ly.learned_sinks, ly.scale) for ly in spec.layers}


def _transformers(model_type: str, cfg: dict) -> tuple:
    transformers = extras.require("transformers")
    c = getattr(transformers, CLASSES[model_type]).from_dict(dict(cfg))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cap = getattr(c, "attn_logit_softcapping", None) or 0.0
    scalar = getattr(c, "query_pre_attn_scalar", None)
    return head_dim, float(cap), model_type == "gpt_oss", None if scalar is None else scalar**-0.5


@pytest.mark.parametrize("model_type,extra", FILES, ids=[f"{t}-{sorted(e)}" for t, e in FILES])
def test_features_map_as_transformers_reads_them(model_type, extra):
    cfg = {"model_type": model_type, "num_hidden_layers": N, **SHAPE, **extra}
    assert _features(model_spec_from_hf(cfg)) == {_transformers(model_type, cfg)}


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_transformers_default_configs_written_out(model_type):
    transformers = extras.require("transformers")
    config = getattr(transformers, CLASSES[model_type])(num_hidden_layers=N, **SHAPE)
    written = json.loads(json.dumps(config.to_dict()))
    assert _features(model_spec_from_hf(written)) == {_transformers(model_type, written)}


def test_hub_files():
    gemma = model_spec_from_hf(GEMMA2_9B)
    assert _features(gemma) == {(256, 50.0, False, 256**-0.5)}
    assert gemma.layers[0].heads[0].sliding_window == 4096 and gemma.layers[1].is_dense
    assert _features(model_spec_from_hf(GEMMA2_27B)) == {(128, 50.0, False, 144**-0.5)}
    oss = model_spec_from_hf(GPT_OSS_20B)
    assert _features(oss) == {(64, 0.0, True, None)}
    assert oss.layers[0].features == ("learned_sinks",)
    for plain in (MISTRAL_7B_V01, QWEN3_8B):
        assert all(not ly.features and ly.scale is None for ly in model_spec_from_hf(plain).layers)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
        ({"attn_logit_softcapping": True}, "attn_logit_softcapping"),
        ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
        ({"attn_logit_softcapping": 1e9}, "logit_softcap"),  # past LayerSpec's MAX_SOFTCAP
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        ({"query_pre_attn_scalar": "256"}, "query_pre_attn_scalar"),
        ({"attention_chunk_size": 8192}, "attention_chunk_size"),
        ({"head_dim": 272}, "head_dim"),
        ({"head_dim": 40}, "head_dim"),
    ],
)
def test_unhonoured_fields_are_refused_naming_them(extra, field):
    cfg = {**GEMMA2_9B, **extra}
    with pytest.raises(SpecError, match=field) as info:
        model_spec_from_hf(cfg)
    assert "\n" not in str(info.value)
