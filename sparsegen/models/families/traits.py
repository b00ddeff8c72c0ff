"""`Traits`: what sets one decoder family apart from the others (norms, biases, MLP, scales), and
the transformers defaults its config class applies when `config.json` omits a field. Each family
module (`llama`, `mistral`, `qwen2`, `qwen3`) is one `Traits` value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Traits:
    model_type: str
    # transformers' config-class defaults for the fields `DecoderConfig` reads (absent in the file)
    defaults: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool | None = None  # fixed by the family (Qwen2: q/k/v biased); None: `attention_bias`
    o_bias: bool | None = None  # fixed (Qwen2: False); None: `attention_bias`
    mlp_bias: bool | None = None  # fixed; None: the config's `mlp_bias`
    qk_norm: bool = False  # RMSNorm over each head's q and k before the rotary (Qwen3)
    head_dim_default: int | None = None  # head_dim when absent and not hidden / heads (Qwen3: 128)


COMMON_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
