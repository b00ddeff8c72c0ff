"""What `LLM` is built from: the device and dtype it was asked for, the tokenizer and model of a
checkpoint folder or a named random size, and the one engine over them (`build_engine`)."""

from __future__ import annotations

import inspect

import torch

from ..engine import LLMEngine
from ..errors import InputError
from ..models.families import RANDOM_NAMES
from ..parallel.source import ModelSource

DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
RANDOM_SIZES = RANDOM_NAMES  # Phi-3-Small's tiny and 7b, then the family presets (models.families)
# the LLMEngine keywords that LLM passes through (LLM takes the model, tokenizer, device and
# tensor_parallel_size itself)
ENGINE_OPTIONS = tuple(
    p
    for p in inspect.signature(LLMEngine.__init__).parameters
    if p not in ("self", "model", "tokenizer", "device", "tensor_parallel_size")
)


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise InputError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise InputError(f"device {device!r} is not a torch device (use 'cuda', 'cuda:N' or 'cpu')") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r} was asked for, but torch sees no CUDA GPU")
    return dev


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise InputError(f"dtype must be one of {sorted(DTYPE_NAMES)} or 'auto', got {dtype!r}")


def build_tokenizer(model_dir, random, tokenizer_path):
    """The tokenizer for a checkpoint folder (None if it has none) or a named random size."""
    from ..models.config import TINY_SPECIAL_TOKENS
    from ..models.families import random_config
    from ..tokenizer import PHI3SMALL_SPECIAL_TOKENS, ByteTokenizer, load_tokenizer

    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path)
    if model_dir is not None:  # tokenizer.json first, else a .tiktoken file, else none
        from pathlib import Path

        from ..errors import CheckpointError
        from ..folders import contained_file
        from ..models.families import config_from_file
        from .checkpoint_text import load_folder_tokenizer

        # padded to the model's vocabulary (Qwen2's embedding has rows past its tokenizer's ids):
        # an id the model can sample then decodes to nothing, rather than failing its request
        where = contained_file(Path(model_dir), "config.json", f"checkpoint {model_dir} has", CheckpointError)
        return load_folder_tokenizer(model_dir, config_from_file(where).vocab_size)
    config = random_config(random)
    if random not in ("tiny", "7b"):  # a family preset: bytes, no special tokens
        return ByteTokenizer({}, config.vocab_size)
    if random == "tiny":
        return ByteTokenizer(TINY_SPECIAL_TOKENS, config.vocab_size)
    # bytes plus Phi-3-Small's named special tokens; every other id is masked out
    named = {k: v for k, v in PHI3SMALL_SPECIAL_TOKENS.items() if "dummy_id" not in k}
    return ByteTokenizer(named, config.vocab_size)


def model_source(model_dir, random, tokenizer_path, dtype, force_dense=False, seed=0):
    """(ModelSource, tokenizer or None) for a checkpoint folder or a named random size: the weights
    that `LLMEngine` builds in this process or in its tensor-parallel ranks."""
    tokenizer = build_tokenizer(model_dir, random, tokenizer_path)
    source = ModelSource(
        model_dir=str(model_dir) if model_dir is not None else None,
        random=random,
        seed=seed,
        dtype=str(dtype).removeprefix("torch."),
        force_dense=force_dense,
        dummy_token_indices=tuple(tokenizer.dummy_token_indices) if tokenizer is not None else (),
    )
    return source, tokenizer


def build_engine(model_dir, random, tokenizer_path, device, dtype, force_dense, seed, tensor_parallel_size,
                 engine_options):  # fmt: skip
    """(engine, tokenizer or None, model config): the one engine `LLM` drives. With
    `tensor_parallel_size` > 1 the engine runs the model over that many processes, one GPU each
    (`parallel.executor`); nothing here changes for it."""
    source, tok = model_source(model_dir, random, tokenizer_path, dtype, force_dense, seed)
    engine = LLMEngine(source, tokenizer=tok, device=device, tensor_parallel_size=tensor_parallel_size,
                       **engine_options)  # fmt: skip
    return engine, tok, engine.model_config
