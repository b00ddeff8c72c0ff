"""Gemma-3 (text): Gemma-2's layers with (1 + w) q/k RMSNorms, no soft-caps unless the config
sets them, and two rotary bases: `rope_parameters` per layer type (or `rope_theta` for the
global layers, `rope_local_base_freq` for the windowed ones)."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "gemma3_text",
    defaults={**COMMON_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072, "num_key_value_heads": 4,
              "head_dim": 256, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
              "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
              "attn_logit_softcapping": None, "final_logit_softcapping": None},
    act_key="hidden_activation",
    norm_offset=1.0,
    embed_scale=True,
    sandwich=True,
    softcaps=True,
    query_scalar=True,
    qk_norm=True,
    local_rope=True,
    mlp_bias=False,  # transformers' config has no mlp_bias: the MLP is never biased
)  # fmt: skip
