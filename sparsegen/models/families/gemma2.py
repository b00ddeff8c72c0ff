"""Gemma-2: (1 + w) RMSNorms before and after attention and the MLP, GeGLU-tanh MLP, embeddings
times sqrt(hidden), scale query_pre_attn_scalar ** -0.5, attention scores soft-capped at
`attn_logit_softcapping` (50) and logits at `final_logit_softcapping` (30); even layers windowed."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "gemma2",
    defaults={**COMMON_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192, "num_key_value_heads": 4,
              "head_dim": 256, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
              "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    act_key="hidden_activation",
    norm_offset=1.0,
    embed_scale=True,
    sandwich=True,
    softcaps=True,
    query_scalar=True,
    mlp_bias=False,  # transformers' config has no mlp_bias: the MLP is never biased
)  # fmt: skip
