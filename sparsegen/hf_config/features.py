"""The layer-wide attention features an HF `config.json` implies, as transformers' config and
model classes for its `model_type` use them, with those classes' defaults:

  gemma2, gemma3_text   `attn_logit_softcapping` -> LayerSpec.logit_softcap (Gemma-2's default
                        50.0, Gemma-3's null = off); `query_pre_attn_scalar` (default 256) ->
                        LayerSpec.scale = query_pre_attn_scalar ** -0.5; `head_dim` defaults to 256
  gpt_oss               every attention layer has learned sinks (GptOssAttention.sinks): learned_sinks
  other model types     `attn_logit_softcapping` and `query_pre_attn_scalar` when present (null: off)

A field sparsegen cannot honour (`attention_chunk_size`: chunked attention) is a SpecError
naming it. Gemma's `final_logit_softcapping` caps the LM head's logits, not attention scores,
and belongs to the model, not to an attention spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SpecError
from .fields import _value, get_float

GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")
SOFTCAP_DEFAULTS = {"gemma2": 50.0}  # absent from the file: the config class's default (else off)
HEAD_DIM_DEFAULTS = {"gemma2": 256, "gemma3_text": 256, "gemma3": 256}
UNHONOURED = ("attention_chunk_size",)


@dataclass(frozen=True)
class LayerFeatures:
    logit_softcap: float = 0.0
    learned_sinks: bool = False
    scale: float | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"logit_softcap": self.logit_softcap, "learned_sinks": self.learned_sinks, "scale": self.scale}


def default_head_dim(cfg: dict[str, Any]) -> int | None:
    """The head_dim a model type's config class has when the file gives none (Gemma: 256)."""
    model_type = _value(cfg, "model_type", None)
    return HEAD_DIM_DEFAULTS.get(model_type) if isinstance(model_type, str) else None


def layer_features(cfg: dict[str, Any], source: str) -> LayerFeatures:
    """Soft-cap, learned sinks and the softmax scale every attention layer of `cfg` uses."""
    for key in UNHONOURED:
        if _value(cfg, key, None) is not None:
            raise SpecError(
                f"{source}: field {key!r} = {cfg[key]!r:.40} (chunked attention) cannot be honoured"
            )
    model_type = _value(cfg, "model_type", None)
    model_type = model_type if isinstance(model_type, str) else None
    kw = {"source": source, "error": SpecError}
    cap = _value(cfg, "attn_logit_softcapping", SOFTCAP_DEFAULTS.get(model_type))
    softcap = 0.0 if cap is None else get_float({"attn_logit_softcapping": cap}, "attn_logit_softcapping",
                                                 nonnegative=True, **kw)  # fmt: skip
    scalar = _value(cfg, "query_pre_attn_scalar", 256 if model_type in GEMMA_TYPES else None)
    scale = None
    if scalar is not None:
        scale = (
            get_float({"query_pre_attn_scalar": scalar}, "query_pre_attn_scalar", positive=True, **kw) ** -0.5
        )
    return LayerFeatures(logit_softcap=softcap, learned_sinks=model_type == "gpt_oss", scale=scale)
