"""Named patterns and loaders: `get_pattern(name_or_path)` -> `ModelSpec`.

A pattern comes from a preset name, a sparsegen JSON spec file (`ModelSpec.to_json`), or an
HF `config.json` that carries Phi-3-Small's `blocksparse_*` fields or a `sliding_window`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import SpecError
from .spec import SPEC_FORMAT, HeadSpec, LayerSpec, ModelSpec


def blocksparse_heads(
    num_heads: int,
    *,
    block_size: int,
    local_blocks: int,
    vert_stride: int,
    homo_head: bool = False,
    head_sliding_step: int | None = None,
    first_head: int = 0,
    total_heads: int | None = None,
) -> tuple[HeadSpec, ...]:
    """Phi-3-Small style heads: offset of global head h is `h * head_sliding_step`.

    `first_head`/`total_heads` serve tensor-parallel shards: the offset follows the *global*
    head index, and the default step `max(1, vert_stride // total_heads)` uses the global count.
    """
    total = total_heads if total_heads is not None else num_heads
    if head_sliding_step is None:
        head_sliding_step = 0 if homo_head else max(1, vert_stride // total)
    stride = max(vert_stride, 1)
    return tuple(
        HeadSpec(
            block_size=block_size,
            local_blocks=local_blocks,
            vert_stride=vert_stride,
            vert_offset=((first_head + h) * head_sliding_step) % stride if vert_stride else 0,
        )
        for h in range(num_heads)
    )


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
    """A preset name, a sparsegen JSON spec file, or an HF `config.json`."""
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key][0]()
    path = Path(key)
    if not path.is_file():
        raise SpecError(f"pattern {key!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read pattern file {path}: {exc}") from None
    if isinstance(data, dict) and data.get("format") == SPEC_FORMAT:
        return ModelSpec.from_dict(data)
    if isinstance(data, dict) and ("num_attention_heads" in data or "model_type" in data):
        return from_hf_config(data, name=path.parent.name or path.stem)
    raise SpecError(f"{path} is neither a sparsegen spec (format {SPEC_FORMAT!r}) nor an HF config.json")


def _cfg_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise SpecError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"config.json field {key!r} must be an int, got {value!r}")
    return value


def from_hf_config(cfg: dict[str, Any], name: str = "hf-config") -> ModelSpec:
    """Map an HF config's attention fields onto a ModelSpec.

    Read: num_attention_heads, num_key_value_heads, hidden_size / head_dim,
    num_hidden_layers, blocksparse_{block_size, num_local_blocks, vert_stride,
    homo_head_pattern}, dense_attention_every_n_layers, sliding_window / use_sliding_window.
    A config that mixes block sparsity with a sliding window is refused: no such model exists,
    and guessing would silently change its attention.
    """
    num_heads = _cfg_int(cfg, "num_attention_heads")
    num_kv = _cfg_int(cfg, "num_key_value_heads", num_heads)
    num_layers = _cfg_int(cfg, "num_hidden_layers")
    if num_heads < 1 or num_layers < 1:
        raise SpecError(f"config.json: num_attention_heads={num_heads}, num_hidden_layers={num_layers}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = _cfg_int(cfg, "hidden_size")
        if hidden % num_heads:
            raise SpecError(f"config.json: hidden_size {hidden} is not a multiple of {num_heads} heads")
        head_dim = hidden // num_heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise SpecError(f"config.json field 'head_dim' must be an int, got {head_dim!r}")

    blocksparse = any(k.startswith("blocksparse_") for k in cfg)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise SpecError(f"config.json field 'sliding_window' must be an int or null, got {window!r}")
    if blocksparse and window:
        raise SpecError(
            "config.json has both blocksparse_* fields and sliding_window; "
            "sparsegen cannot tell how they combine in this model"
        )
    if "layer_types" in cfg or "max_window_layers" in cfg:
        raise SpecError(
            "config.json uses per-layer attention types (layer_types/max_window_layers), "
            "which sparsegen does not map yet"
        )

    dense_layer = _uniform_layer(num_heads, num_kv, head_dim, HeadSpec(dense=True))
    if blocksparse:
        heads = blocksparse_heads(
            num_heads,
            block_size=_cfg_int(cfg, "blocksparse_block_size", 64),
            local_blocks=_cfg_int(cfg, "blocksparse_num_local_blocks", 16),
            vert_stride=_cfg_int(cfg, "blocksparse_vert_stride", 8),
            homo_head=bool(cfg.get("blocksparse_homo_head_pattern", False)),
        )
        sparse_layer = LayerSpec(num_heads, num_kv, head_dim, heads)
        every = _cfg_int(cfg, "dense_attention_every_n_layers", 0)
        if every < 0:
            raise SpecError(f"config.json field 'dense_attention_every_n_layers' must be >= 0, got {every}")
        layers = tuple(
            dense_layer if every and (i + 1) % every == 0 else sparse_layer for i in range(num_layers)
        )
    elif window:
        layers = (_uniform_layer(num_heads, num_kv, head_dim, HeadSpec(sliding_window=window)),) * num_layers
    else:
        layers = (dense_layer,) * num_layers
    return ModelSpec(name, layers)
