"""Qwen3: RMSNorm over each head's q and k (`q_norm`, `k_norm`), `attention_bias` on all four
projections, head_dim 128 unless given; windows as Qwen2's."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "qwen3",
    defaults={
        **COMMON_DEFAULTS,
        "num_key_value_heads": 32,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
    },  # fmt: skip
    mlp_bias=False,
    qk_norm=True,
    head_dim_default=128,
)
