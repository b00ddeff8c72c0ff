"""Decoder-family configs read as transformers' own config classes read the same file (their
defaults when a field is absent), the rotary variants' frequencies against transformers'
`ROPE_INIT_FUNCTIONS`, and bad configs refused with a CheckpointError naming the field."""

from __future__ import annotations

import pytest
import torch
from helpers.extras import require

from sparsegen.errors import CheckpointError
from sparsegen.models.families import FAMILY_TYPES, config_from_dict
from sparsegen.models.families.rope import inv_freq

transformers = require("transformers")

CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "gpt_oss": "GptOssConfig",
}
MINIMAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=32)


def hf_config(model_type: str, fields: dict):
    return getattr(transformers, CLASSES[model_type])(**fields)


@pytest.mark.parametrize("model_type", sorted(CLASSES))
@pytest.mark.parametrize(
    "extra", [{}, {"num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": True}]
)
def test_defaults_equal_transformers_config_class(model_type, extra):
    fields = {**MINIMAL, **extra}
    ours = config_from_dict({"model_type": model_type, **fields})
    theirs = hf_config(model_type, fields)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == head_dim
    for key in ("vocab_size", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):  # fmt: skip
        assert getattr(ours, key) == getattr(theirs, key), key
    rope = theirs.rope_parameters
    if model_type == "gemma3_text":  # one rotary per layer type
        assert (ours.rope.theta, ours.local_rope.theta) == (rope["full_attention"]["rope_theta"],
                                                            rope["sliding_attention"]["rope_theta"])  # fmt: skip
    else:
        assert (ours.rope.theta, ours.rope.rope_type) == (rope["rope_theta"], rope["rope_type"])
    if model_type in ("gemma2", "gemma3_text"):
        assert ours.attention_scale == theirs.query_pre_attn_scalar**-0.5
        assert ours.attn_softcap == (theirs.attn_logit_softcapping or 0.0)
        assert ours.final_softcap == (theirs.final_logit_softcapping or 0.0)
        assert (ours.act, ours.norm_offset, ours.embed_scale) == ("gelu_tanh", 1.0, theirs.hidden_size**0.5)
    if model_type == "gpt_oss":
        assert (ours.num_experts, ours.experts_per_tok) == (
            theirs.num_local_experts,
            theirs.num_experts_per_tok,
        )
        assert (ours.swiglu_limit, ours.swiglu_alpha) == (theirs.swiglu_limit, theirs.swiglu_alpha)
        assert ours.rope.factor == rope["factor"] and ours.rope.truncate == rope["truncate"]


def test_gemma3_old_style_rope_fields():
    cfg = config_from_dict({"model_type": "gemma3_text", **MINIMAL, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
                            "rope_scaling": {"rope_type": "linear", "factor": 8.0}})  # fmt: skip
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 5e5, 8.0)
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 2e4)


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_projection_biases_and_norms_match_transformers_modules(model_type):
    fields = {**MINIMAL, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 32,
              "attention_bias": True}  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, fields))
    attn = hf.model.layers[0].self_attn
    ours = config_from_dict({"model_type": model_type, **fields})
    assert ours.qkv_bias == (attn.q_proj.bias is not None)
    assert ours.o_bias == (attn.o_proj.bias is not None)
    mlp = hf.model.layers[0].mlp
    assert (ours.num_experts > 0) == hasattr(mlp, "experts")
    if not ours.num_experts:
        assert ours.mlp_bias == (mlp.up_proj.bias is not None)
    assert ours.qk_norm == hasattr(attn, "q_norm")
    assert ours.sinks == hasattr(attn, "sinks")
    assert ours.sandwich == hasattr(hf.model.layers[0], "pre_feedforward_layernorm")


ROPES = [
    {"rope_type": "default", "rope_theta": 5e5},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 4096,
     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
]  # fmt: skip


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_rope_frequencies_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {**MINIMAL, "head_dim": 128, "max_position_embeddings": 131072, "rope_parameters": dict(rope)}
    theirs = hf_config("llama", fields)
    ours = config_from_dict({"model_type": "llama", **fields})
    if rope["rope_type"] == "default":
        want = 1.0 / rope["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
        factor = 1.0
    else:
        want, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](theirs, "cpu")
    torch.testing.assert_close(inv_freq(ours.rope).float(), want.float(), rtol=1e-6, atol=0)
    assert ours.rope.attention_factor == pytest.approx(factor if rope["rope_type"] == "yarn" else 1.0)


def test_old_style_rope_theta_and_rope_scaling():
    cfg = config_from_dict({"model_type": "llama", **MINIMAL, "rope_theta": 5e5,
                            "rope_scaling": {"type": "linear", "factor": 2.0}})  # fmt: skip
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 5e5, 2.0)


def test_model_types_served():
    assert set(FAMILY_TYPES) >= {"phi3small", "llama", "mistral", "qwen2", "qwen3"}
    assert type(config_from_dict({"model_type": "phi3small"})).__name__ == "Phi3SmallConfig"


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"model_type": "falcon"}, "model_type is 'falcon'"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama", "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"model_type": "llama", "hidden_size": 250}, "not a multiple of 32 heads"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "linear"}}, "'factor'"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
         "original_max_position_embeddings"),
        ({"model_type": "llama", "rope_parameters": "x"}, "rope_parameters must be an object"),
        ({"model_type": "qwen2", "vocab_size": 1.5}, "'vocab_size' must be an int"),
        ({"model_type": "mistral", "rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"model_type": "qwen3", "tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"model_type": "llama", "eos_token_id": 10**9}, "eos_token_id"),
        ({"model_type": "llama", "num_hidden_layers": 0}, "num_hidden_layers"),
    ],
)  # fmt: skip
def test_bad_config_is_a_checkpoint_error_naming_the_field(fields, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        config_from_dict({**MINIMAL, **fields}, "ckpt/config.json")


@pytest.mark.parametrize("fields,message", [({"sliding_window": 0, "head_dim": 64}, "sliding_window"),
                                            ({"sliding_window": 8}, "head_dim")])  # fmt: skip
def test_attention_spec_errors_are_checkpoint_errors(fields, message):
    cfg = config_from_dict({"model_type": "mistral", **MINIMAL, **fields})
    with pytest.raises(CheckpointError, match=message):
        cfg.attention_spec()


@pytest.mark.parametrize("name", ["QWEN2_5_7B", "QWEN3_8B", "MISTRAL_7B_V01"])
def test_real_configs_read_as_transformers_reads_them(name):
    from helpers import hf_configs

    cfg = getattr(hf_configs, name)
    ours = config_from_dict(cfg)
    theirs = transformers.AutoConfig.for_model(**cfg)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):  # fmt: skip
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]
    assert ours.head_dim == (
        getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    )
    windows = [layer.heads[0].sliding_window for layer in ours.attention_spec().layers]
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    want = [theirs.sliding_window if t == "sliding_attention" and theirs.sliding_window else 0 for t in types]
    assert windows == want
