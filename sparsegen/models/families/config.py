"""`DecoderConfig`: an HF `config.json` of a Llama-style decoder family, read with transformers'
defaults for its `model_type` (`traits.Traits.defaults`). Every bad field is a `CheckpointError`
naming the file and the field. The attention pattern per layer comes from `sparsegen.hf_config`
(`attention_spec`), from the same dict with the family's head_dim filled in."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ...errors import CheckpointError, SpecError
from ...hf_config import get_bool, get_float, get_int, model_spec_from_hf
from ...spec import ModelSpec
from ..config import MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from ..config_dtype import config_dtype
from .rope import RopeParams, read_ropes
from .traits import Traits


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeParams
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_id: int | None
    hf_json: str  # the file's fields (head_dim and num_key_value_heads filled in), for `attention_spec`
    act: str = "silu"  # the MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_offset: float = 0.0  # RMSNorm weight offset (Gemma: 1)
    embed_scale: float = 1.0  # embeddings multiplier (Gemma: sqrt(hidden_size))
    sandwich: bool = False  # post-attention and pre/post-feedforward RMSNorms (Gemma-2/3)
    attn_softcap: float = 0.0  # LayerSpec.logit_softcap (0: off)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (0: off)
    query_scalar: float | None = None  # softmax scale query_scalar ** -0.5 (None: head_dim ** -0.5)
    local_rope: RopeParams | None = None  # the windowed layers' rotary (Gemma-3); None: `rope` for all
    sinks: bool = False  # learned sink logits per head (gpt-oss)
    num_experts: int = 0  # > 0: a mixture of experts replaces the MLP (gpt-oss)
    experts_per_tok: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    # what the engine reads of a config besides the sizes: no LongRoPE switch, no dummy ids
    rope_scaling = None
    dummy_token_indices = None

    @property
    def ff_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        return (self.query_scalar if self.query_scalar is not None else self.head_dim) ** -0.5

    def hf_dict(self) -> dict[str, Any]:
        return json.loads(self.hf_json)

    def parameter_count(self) -> int:
        """Parameters of the model (lm_head counted: random models untie it)."""
        h, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer = (
            2 * h  # two RMSNorms
            + h * (q + 2 * kv) + (q + 2 * kv) * self.qkv_bias
            + q * h + h * self.o_bias
            + 3 * h * f + (2 * f + h) * self.mlp_bias
            + 2 * d * self.qk_norm
            + 2 * h * self.sandwich
        )  # fmt: skip
        if self.num_experts:
            e = self.num_experts
            per_layer += e * (3 * h * f + 2 * f + h) + e * h + e - (3 * h * f + (2 * f + h) * self.mlp_bias)
            per_layer += self.num_attention_heads * self.sinks
        return 2 * v * h + self.num_hidden_layers * per_layer + h

    def attention_spec(self, name: str | None = None) -> ModelSpec:
        """Windows per layer from `hf_config`; each layer also soft-capped, with learned sinks and
        its softmax scale as the family says."""
        try:
            spec = model_spec_from_hf(self.hf_dict(), name=name or self.model_type)
            layers = tuple(replace(layer, logit_softcap=self.attn_softcap, learned_sinks=self.sinks,
                                   scale=self.attention_scale) for layer in spec.layers)  # fmt: skip
            return ModelSpec(spec.name, layers)
        except SpecError as exc:
            raise CheckpointError(str(exc)) from None


def _token(cfg: dict[str, Any], key: str, default, vocab: int, source: str) -> int | None:
    value = cfg.get(key, default)
    if isinstance(value, list):  # several EOS ids: the first is the engine's stop token
        value = value[0] if value else None
    if value is None:
        return None
    return get_int({key: value}, key, minimum=0, maximum=vocab - 1, source=source, error=CheckpointError)


def read_decoder_config(cfg: dict[str, Any], traits: Traits, source: str) -> DecoderConfig:
    """`cfg` (a parsed config.json of `traits.model_type`) as a DecoderConfig."""
    d = traits.defaults
    kw = {"source": source, "error": CheckpointError}
    config_dtype(cfg, source)  # a dtype transformers would not load, or sparsegen cannot honour

    def val(key):
        return cfg.get(key) if cfg.get(key) is not None else d.get(key)

    def num(key, lo=1, hi=MAX_WIDTH):
        return get_int({key: val(key)}, key, minimum=lo, maximum=hi, **kw)

    def flag(key):
        return get_bool({key: val(key)}, key, **kw)

    vocab = num("vocab_size", hi=MAX_VOCAB)
    hidden = num("hidden_size")
    layers = num("num_hidden_layers", hi=MAX_LAYERS)
    heads = num("num_attention_heads", hi=4096)
    kv_heads = num("num_key_value_heads", hi=4096) if val("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")  # fmt: skip
    if val("head_dim") is not None:
        head_dim = num("head_dim", hi=1024)
    elif traits.head_dim_default is not None:
        head_dim = traits.head_dim_default
    elif hidden % heads:
        raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of {heads} heads")
    else:
        head_dim = hidden // heads
    act = val(traits.act_key)
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise CheckpointError(f"{source}: {traits.act_key} {act!r:.40} is not an activation sparsegen runs "
                              f"({', '.join(acts)})")  # fmt: skip
    max_pos = num("max_position_embeddings", hi=2**24)
    bias = flag("attention_bias")

    def softcap(key):
        value = val(key)
        return 0.0 if value is None else get_float({key: value}, key, positive=True, **kw)

    experts = num("num_local_experts", hi=4096) if traits.moe else 0
    global_rope, local_rope = read_ropes(cfg, d, head_dim, max_pos, traits.local_rope, source)
    return DecoderConfig(
        model_type=traits.model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=num("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get_float({"rms_norm_eps": val("rms_norm_eps")}, "rms_norm_eps", positive=True, **kw),
        rope=global_rope,
        act=acts[act],
        norm_offset=traits.norm_offset,
        embed_scale=hidden**0.5 if traits.embed_scale else 1.0,
        sandwich=traits.sandwich,
        attn_softcap=softcap("attn_logit_softcapping") if traits.softcaps else 0.0,
        final_softcap=softcap("final_logit_softcapping") if traits.softcaps else 0.0,
        query_scalar=get_float({"q": val("query_pre_attn_scalar")}, "q", positive=True, **kw)
        if traits.query_scalar
        else None,
        local_rope=local_rope,
        sinks=traits.sinks,
        num_experts=experts,
        experts_per_tok=num("num_experts_per_tok", hi=experts) if traits.moe else 0,  # top-k of the experts
        swiglu_limit=get_float({"swiglu_limit": val("swiglu_limit")}, "swiglu_limit", positive=True, **kw)
        if traits.moe
        else 7.0,
        swiglu_alpha=get_float({"swiglu_alpha": val("swiglu_alpha")}, "swiglu_alpha", positive=True, **kw)
        if traits.moe
        else 1.702,
        max_position_embeddings=max_pos,
        tie_word_embeddings=flag("tie_word_embeddings"),
        qkv_bias=bias if traits.qkv_bias is None else traits.qkv_bias,
        o_bias=bias if traits.o_bias is None else traits.o_bias,
        mlp_bias=flag("mlp_bias") if traits.mlp_bias is None else traits.mlp_bias,
        qk_norm=traits.qk_norm,
        bos_token_id=_token(cfg, "bos_token_id", d.get("bos_token_id"), vocab, source),
        eos_token_id=_token(cfg, "eos_token_id", d.get("eos_token_id"), vocab, source),
        hf_json=json.dumps({**cfg, "head_dim": head_dim, "num_key_value_heads": kv_heads}, sort_keys=True),
    )
