"""Models served through sparsegen's attention: Phi-3-Small and the decoder families
(`models.families`: Llama, Mistral, Qwen2/3, Gemma-2/3, gpt-oss), chosen by `model_type`."""

from .batch import ForwardBatch
from .config import NAMED_SIZES, CheckpointError, LongRopeConfig, Phi3SmallConfig, named_config
from .families import FAMILY_TYPES, DecoderConfig, DecoderForCausalLM
from .loader import checkpoint_weight_map, empty_model, load_checkpoint, random_model
from .options import ModelOptions
from .phi3small import Phi3SmallForCausalLM, gegelu, model_spec

__all__ = [
    "NAMED_SIZES",
    "CheckpointError",
    "DecoderConfig",
    "DecoderForCausalLM",
    "FAMILY_TYPES",
    "ForwardBatch",
    "LongRopeConfig",
    "ModelOptions",
    "Phi3SmallConfig",
    "Phi3SmallForCausalLM",
    "checkpoint_weight_map",
    "empty_model",
    "gegelu",
    "load_checkpoint",
    "model_spec",
    "named_config",
    "random_model",
]
