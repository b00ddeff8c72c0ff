"""The model families, chosen by `config.json`'s `model_type`: Phi-3-Small (`models.phi3small`)
and the decoders (Llama, Mistral, Qwen2/3, Gemma-2/3, gpt-oss) (`DecoderForCausalLM` with one `Traits` per family module).

`config_from_dict` reads a config of any family; `model_class` is the module class that builds
it; `FAMILY_TYPES` lists the model types served."""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointError
from ..config import NAMED_SIZES, Phi3SmallConfig, named_config
from . import gemma2, gemma3_text, gpt_oss, llama, mistral, qwen2, qwen3
from .config import DecoderConfig, read_decoder_config
from .model import DecoderForCausalLM, decoder_spec
from .presets import PRESETS

DECODERS = {
    m.TRAITS.model_type: m.TRAITS for m in (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt_oss)
}
FAMILY_TYPES = ("phi3small", *DECODERS)
RANDOM_NAMES = (*NAMED_SIZES, *PRESETS)  # what `--random` / `LLM(random=)` / `random_model` take


def config_from_dict(cfg: dict[str, Any], source: str = "config.json") -> Phi3SmallConfig | DecoderConfig:
    model_type = cfg.get("model_type", "phi3small")
    if model_type in DECODERS:
        return read_decoder_config(cfg, DECODERS[model_type], source)
    if model_type == "phi3small":
        return Phi3SmallConfig.from_hf_dict(cfg, source)
    raise CheckpointError(
        f"{source}: model_type is {model_type!r:.40}; sparsegen runs {', '.join(FAMILY_TYPES)}"
    )


def random_config(name: str) -> Phi3SmallConfig | DecoderConfig:
    """The config of a named random size: Phi-3-Small's (`tiny`, `7b`) or a family preset."""
    if isinstance(name, str) and name in PRESETS:
        return config_from_dict(PRESETS[name], f"preset {name}")
    if isinstance(name, str) and name in NAMED_SIZES:
        return named_config(name)
    raise CheckpointError(f"unknown model size {name!r}; expected one of {RANDOM_NAMES}")


def config_from_file(path) -> Phi3SmallConfig | DecoderConfig:
    from ..config import read_config_json

    return config_from_dict(read_config_json(path), str(path))


def model_class(config) -> type:
    from ..phi3small import Phi3SmallForCausalLM

    return DecoderForCausalLM if isinstance(config, DecoderConfig) else Phi3SmallForCausalLM


__all__ = [
    "PRESETS",
    "RANDOM_NAMES",
    "random_config","DECODERS", "FAMILY_TYPES", "DecoderConfig", "DecoderForCausalLM", "config_from_dict",
           "config_from_file", "decoder_spec", "model_class"]  # fmt: skip
