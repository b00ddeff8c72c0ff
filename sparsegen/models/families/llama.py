"""Llama (and Llama-3's rope): SwiGLU, RMSNorm, optional `attention_bias` / `mlp_bias`, no window."""

from .traits import COMMON_DEFAULTS, Traits

TRAITS = Traits(
    "llama",
    defaults={**COMMON_DEFAULTS, "vocab_size": 32000, "max_position_embeddings": 2048},
)
