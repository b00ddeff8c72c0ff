"""Fields a family's transformers config class ignores, decided with transformers as the oracle:
a field the class neither declares nor lets change any other attribute (`AutoConfig.for_model`,
`to_dict`) must leave sparsegen's reading (every DecoderConfig field and the attention spec) as
it was, unless it is on the list below of fields transformers' modeling code reads anyway
(`getattr(config, ...)`) or that sparsegen refuses because it cannot honour them. Also the
fields transformers does read that sparsegen could not run (partial rotary) are refused naming
the field."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from helpers.extras import require

from sparsegen.errors import CheckpointError
from sparsegen.models.families import DECODERS, config_from_dict

transformers = require("transformers")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
PROBES = {
    "attention_bias": True, "mlp_bias": True, "sliding_window": 32, "use_sliding_window": True,
    "max_window_layers": 1, "layer_types": ["sliding_attention"] * 3, "attn_logit_softcapping": 30.0,
    "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 7, "head_dim": 32, "swiglu_limit": 3.0,
    "swiglu_alpha": 1.0, "num_local_experts": 4, "num_experts_per_tok": 1,
    "use_bidirectional_attention": True, "sliding_window_pattern": 2, "_sliding_window_pattern": 2,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "silu", "qkv_bias": False, "qk_norm": True,
    "logit_scale": 0.5, "norm_topk_prob": False, "rope_local_base_freq": 77.0, "decoder_sparse_step": 2,
    "attention_chunk_size": 16, "moe_intermediate_size": 64,
}  # fmt: skip
# ignored by the config class, yet read elsewhere in transformers, or refused as unhonourable
READ_ANYWAY = {
    ("qwen2", "head_dim"): "Qwen2Attention reads getattr(config, 'head_dim', hidden / heads)",
}
REFUSED = {
    **{
        (m, "attention_chunk_size"): "masking_utils reads it (chunked masks); sparsegen has none"
        for m in DECODERS
    },
    ("gemma3_text", "_sliding_window_pattern"): "refused when it disagrees with the pattern the class reads",
}


def base(model_type: str) -> dict:
    extra = dict(num_local_experts=4, num_experts_per_tok=2) if model_type == "gpt_oss" else {}
    return {**SHAPE, **extra}


def ours(model_type: str, fields: dict):
    c = config_from_dict({"model_type": model_type, **fields})
    return {
        f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "hf_json"
    }, c.attention_spec()


def ignored_by_transformers(model_type: str, key: str, fields: dict) -> bool:
    if key in transformers.CONFIG_MAPPING[model_type].__annotations__:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        without = transformers.AutoConfig.for_model(model_type, **fields).to_dict()
        try:
            with_it = transformers.AutoConfig.for_model(model_type, **fields, **{key: PROBES[key]}).to_dict()
        except Exception:
            return False  # transformers refuses it: not ignored
    return {k: v for k, v in with_it.items() if k != key} == {k: v for k, v in without.items() if k != key}


# (model_type, field): the probes transformers' config class ignores (chosen when collected)
CASES = [
    (m, k)
    for m in sorted(DECODERS)
    for k in PROBES
    if k not in base(m) and ignored_by_transformers(m, k, base(m))
]


@pytest.mark.parametrize("model_type,key", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_a_field_transformers_ignores_changes_nothing(model_type, key):
    fields = base(model_type)
    if (model_type, key) in READ_ANYWAY:
        assert ours(model_type, {**fields, key: PROBES[key]}) != ours(model_type, fields)
        return
    if (model_type, key) in REFUSED:
        with pytest.raises(CheckpointError, match=key):
            ours(model_type, {**fields, key: PROBES[key]})
        return
    assert ours(model_type, {**fields, key: PROBES[key]}) == ours(model_type, fields)


def test_the_oracle_sees_a_field_it_reads():
    """The oracle is not blind: gemma2's config reads sliding_window, llama's ignores it; and
    the cases cover every family."""
    assert {m for m, _ in CASES} == set(DECODERS) and len(CASES) > 3 * len(DECODERS)
    assert not ignored_by_transformers("gemma2", "sliding_window", base("gemma2"))
    assert ignored_by_transformers("llama", "sliding_window", base("llama"))


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gpt_oss"])
def test_mlp_bias_is_off_where_the_config_has_none(model_type):
    """Gemma's and gpt-oss's MLPs are never biased: `mlp_bias: true` there changes nothing."""
    assert ours(model_type, {**base(model_type), "mlp_bias": True})[0]["mlp_bias"] is False


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gpt_oss"])
def test_bidirectional_is_causal_where_the_model_ignores_it(model_type):
    assert ours(model_type, {**base(model_type), "use_bidirectional_attention": True}) == ours(
        model_type, base(model_type)
    )


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_bidirectional_is_refused_where_the_model_reads_it(model_type):
    with pytest.raises(CheckpointError, match="use_bidirectional_attention"):
        ours(model_type, {**base(model_type), "use_bidirectional_attention": True})


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gpt_oss", "gemma2"])
@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_is_refused_naming_the_field(model_type, where):
    """transformers rotates a part of each head (it folds a top-level factor into
    rope_parameters); sparsegen rotates whole heads, so a factor under 1 is refused."""
    fields = base(model_type)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoConfig.for_model(
            model_type, **fields, rope_parameters=rope, partial_rotary_factor=0.5
        )
    assert hf.rope_parameters["partial_rotary_factor"] == 0.5  # transformers reads it
    extra = {"partial_rotary_factor": 0.5} if where == "top" else {}
    rope = {**rope, "partial_rotary_factor": 0.5} if where != "top" else rope
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        ours(model_type, {**fields, "rope_parameters": rope, **extra})
    ours(
        model_type,
        {**fields, "rope_parameters": rope | {"partial_rotary_factor": 1.0}, "partial_rotary_factor": 1.0},
    )
