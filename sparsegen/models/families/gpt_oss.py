"""gpt-oss: biased q/k/v/o projections, a learned sink logit per head (`self_attn.sinks`), yarn
rope, 128-token windows on even layers, and a mixture of experts (`moe`): a biased top-k router
and clamped SwiGLU experts (`swiglu_limit`, `swiglu_alpha`)."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "gpt_oss",
    defaults={**COMMON_DEFAULTS, "vocab_size": 201088, "max_position_embeddings": 131072, "num_key_value_heads": 8,
              "head_dim": 64, "rms_norm_eps": 1e-5, "attention_bias": True, "bos_token_id": None,
              "eos_token_id": None, "rope_theta": 150000.0, "num_local_experts": 128, "num_experts_per_tok": 4,
              "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}},
    sinks=True,
    moe=True,
    mlp_bias=False,  # transformers' config has no mlp_bias: the MLP is never biased
)  # fmt: skip
