"""Qwen2: biased q/k/v projections (o_proj unbiased); windows from `max_window_layers` on when
`use_sliding_window` (`hf_config`)."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "qwen2",
    defaults={
        **COMMON_DEFAULTS,
        "num_key_value_heads": 32,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
    },  # fmt: skip
    qkv_bias=True,
    o_bias=False,
    mlp_bias=False,
)
