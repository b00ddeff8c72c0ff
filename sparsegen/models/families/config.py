"""`DecoderConfig`: an HF `config.json` of a Llama-style decoder family, read with transformers'
defaults for its `model_type` (`traits.Traits.defaults`). Every bad field is a `CheckpointError`
naming the file and the field. The attention pattern per layer comes from `sparsegen.hf_config`
(`attention_spec`), from the same dict with the family's head_dim filled in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError, SpecError
from ...hf_config import get_bool, get_float, get_int, model_spec_from_hf
from ...spec import ModelSpec
from ..config import MAX_LAYERS, MAX_VOCAB, MAX_WIDTH
from .rope import RopeParams, read_rope
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
    hf: tuple[tuple[str, Any], ...]  # the file's fields (with head_dim), for `attention_spec`

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
        return self.head_dim**-0.5

    def hf_dict(self) -> dict[str, Any]:
        return dict(self.hf)

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
        )  # fmt: skip
        return 2 * v * h + self.num_hidden_layers * per_layer + h

    def attention_spec(self, name: str | None = None) -> ModelSpec:
        try:
            return model_spec_from_hf(self.hf_dict(), name=name or self.model_type)
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
    if cfg.get("head_dim") is not None:
        head_dim = num("head_dim", hi=1024)
    elif traits.head_dim_default is not None:
        head_dim = traits.head_dim_default
    elif hidden % heads:
        raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of {heads} heads")
    else:
        head_dim = hidden // heads
    act = val("hidden_act")
    if act not in ("silu", "swish"):
        raise CheckpointError(
            f"{source}: hidden_act {act!r:.40}; sparsegen's {traits.model_type} runs silu only"
        )
    max_pos = num("max_position_embeddings", hi=2**24)
    bias = flag("attention_bias")
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
        rope=read_rope(cfg, d["rope_theta"], head_dim, max_pos, source),
        max_position_embeddings=max_pos,
        tie_word_embeddings=flag("tie_word_embeddings"),
        qkv_bias=bias if traits.qkv_bias is None else traits.qkv_bias,
        o_bias=bias if traits.o_bias is None else traits.o_bias,
        mlp_bias=flag("mlp_bias") if traits.mlp_bias is None else traits.mlp_bias,
        qk_norm=traits.qk_norm,
        bos_token_id=_token(cfg, "bos_token_id", d.get("bos_token_id"), vocab, source),
        eos_token_id=_token(cfg, "eos_token_id", d.get("eos_token_id"), vocab, source),
        hf=tuple(sorted({**cfg, "head_dim": head_dim, "num_key_value_heads": kv_heads}.items())),
    )
