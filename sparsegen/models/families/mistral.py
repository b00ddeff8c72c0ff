"""Mistral: Llama's layers without biases; every layer windowed (`sliding_window`, `hf_config`)."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "mistral",
    defaults={
        **COMMON_DEFAULTS,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 131072,
    },
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
)
