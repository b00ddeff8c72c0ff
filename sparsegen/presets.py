"""Named patterns and loaders: `get_pattern(name_or_path)` -> `ModelSpec`.

A pattern comes from a preset name, a sparsegen JSON spec file (`ModelSpec.to_json`), or an
HF `config.json` (or the model folder holding it), mapped layer by layer by `hf_config`:
Phi-3-Small's `blocksparse_*` fields, `layer_types`, Qwen2's `max_window_layers`, Gemma-2's
alternation, Mistral's `sliding_window`.
"""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path
from typing import Any

from . import jsonio
from .errors import InputError, SpecError
from .hf_config import blocksparse_heads, model_spec_from_hf
from .spec import SPEC_FORMAT, HeadSpec, LayerSpec, ModelSpec


def _uniform_layer(num_heads: int, num_kv_heads: int, head_dim: int, head: HeadSpec) -> LayerSpec:
    return LayerSpec(num_heads, num_kv_heads, head_dim, (head,) * num_heads)


def phi3small(name: str = "phi3small") -> ModelSpec:
    """Phi-3-Small (8k and 128k share it): 32 layers, odd 0-based layers dense."""
    sparse = LayerSpec(32, 8, 128, blocksparse_heads(32, block_size=64, local_blocks=16, vert_stride=8))
    dense = _uniform_layer(32, 8, 128, HeadSpec(dense=True))
    return ModelSpec(name, tuple(dense if (i + 1) % 2 == 0 else sparse for i in range(32)))


def sliding_window(window: int = 4096, name: str = "sliding-window") -> ModelSpec:
    layer = _uniform_layer(32, 8, 128, HeadSpec(sliding_window=window))
    return ModelSpec(name, (layer,) * 32)


def dense(name: str = "dense") -> ModelSpec:
    return ModelSpec(name, (_uniform_layer(32, 8, 128, HeadSpec(dense=True)),) * 32)


PRESETS = {
    "phi3small": (phi3small, "Phi-3-Small 8k: block 64, 16 local blocks, stride 8, dense every 2nd layer"),
    "phi3small-128k": (
        lambda: phi3small("phi3small-128k"),
        "Phi-3-Small 128k: the same attention pattern as the 8k model",
    ),
    "sliding-window": (sliding_window, "32 heads, 8 KV heads, d=128, window 4096 on every layer"),
    "dense": (dense, "32 heads, 8 KV heads, d=128, plain causal attention on every layer"),
}


def get_pattern(name_or_path: str | Path) -> ModelSpec:
    """A preset name, a sparsegen JSON spec file, an HF `config.json`, or a model folder holding one.

    Errors are `SpecError`s; one caused by a file starts with the file's path.
    """
    key = os.fspath(name_or_path) if isinstance(name_or_path, PathLike) else name_or_path
    if not isinstance(key, str):  # bytes, None, a number, a PathLike that gives bytes...
        raise InputError(
            f"get_pattern takes a preset name or a path, got {type(name_or_path).__name__}: {name_or_path!r:.80}"
        )
    if key in PRESETS:
        return PRESETS[key][0]()
    if not key or "\0" in key:
        raise SpecError(f"pattern {key!r} is neither a preset ({', '.join(PRESETS)}) nor a path")
    path = Path(key)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"model folder {path} has no config.json")
        path = path / "config.json"
    elif not path.is_file():
        raise SpecError(f"pattern {key!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
    data = jsonio.read_json_file(path, SpecError)
    try:
        if isinstance(data, dict) and data.get("format") == SPEC_FORMAT:
            return ModelSpec.from_dict(data)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    if isinstance(data, dict) and ("num_attention_heads" in data or "model_type" in data):
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return from_hf_config(data, name=name or "hf-config", source=str(path))
    raise SpecError(f"{path} is neither a sparsegen spec (format {SPEC_FORMAT!r}) nor an HF config.json")


def from_hf_config(cfg: dict[str, Any], name: str = "hf-config", source: str = "config.json") -> ModelSpec:
    """Map an HF config's attention fields onto a ModelSpec, layer by layer (`hf_config`)."""
    return model_spec_from_hf(cfg, name=name, source=source)
