"""The model families, chosen by `config.json`'s `model_type`: Phi-3-Small (`models.phi3small`)
and the decoders (Llama, Mistral, Qwen2/3, Gemma-2/3, gpt-oss) (`DecoderForCausalLM` with one `Traits` per family module).

`config_from_dict` reads a config of any family; `model_class` is the module class that builds
it; `FAMILY_TYPES` lists the model types served."""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointError
from ..config import Phi3SmallConfig
from . import gemma2, gemma3_text, gpt_oss, llama, mistral, qwen2, qwen3
from .config import DecoderConfig, read_decoder_config
from .model import DecoderForCausalLM, decoder_spec

DECODERS = {
    m.TRAITS.model_type: m.TRAITS for m in (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt_oss)
}
FAMILY_TYPES = ("phi3small", *DECODERS)


def config_from_dict(cfg: dict[str, Any], source: str = "config.json") -> Phi3SmallConfig | DecoderConfig:
    model_type = cfg.get("model_type", "phi3small")
    if model_type in DECODERS:
        return read_decoder_config(cfg, DECODERS[model_type], source)
    if model_type == "phi3small":
        return Phi3SmallConfig.from_hf_dict(cfg, source)
    raise CheckpointError(
        f"{source}: model_type is {model_type!r:.40}; sparsegen runs {', '.join(FAMILY_TYPES)}"
    )


def config_from_file(path) -> Phi3SmallConfig | DecoderConfig:
    from ..config import read_config_json

    return config_from_dict(read_config_json(path), str(path))


def model_class(config) -> type:
    from ..phi3small import Phi3SmallForCausalLM

    return DecoderForCausalLM if isinstance(config, DecoderConfig) else Phi3SmallForCausalLM


__all__ = ["DECODERS", "FAMILY_TYPES", "DecoderConfig", "DecoderForCausalLM", "config_from_dict",
           "config_from_file", "decoder_spec", "model_class"]  # fmt: skip
