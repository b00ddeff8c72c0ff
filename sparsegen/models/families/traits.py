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
    act_key: str = "hidden_act"  # the config field naming the MLP's activation (Gemma: hidden_activation)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma's 1 + w
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich: bool = False  # RMSNorms after attention and around the MLP too (Gemma-2/3)
    softcaps: bool = False  # reads attn_logit_softcapping and final_logit_softcapping (Gemma-2/3)
    query_scalar: bool = False  # softmax scale query_pre_attn_scalar ** -0.5 (Gemma-2/3)
    local_rope: bool = False  # sliding layers rotate with their own base (Gemma-3)
    sinks: bool = False  # a learned sink logit per head, `self_attn.sinks` (gpt-oss)
    moe: bool = False  # a top-k routed mixture of clamped-SwiGLU experts for the MLP (gpt-oss)


COMMON_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
