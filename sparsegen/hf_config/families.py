"""How transformers' config class for each `model_type` lays out a model's attention layers
(dense, sliding window) when reading an HF `config.json`, with that class's defaults
(`FAMILIES`, `layer_kinds`), and the fields a sparsegen spec cannot honour (`check_causal`,
`check_blocksparse_alone`). `hf_config` builds the spec from what these return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SpecError
from .fields import _value, get_bool, get_int

LAYER_TYPES = ("full_attention", "sliding_attention")
QWEN_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Family:
    """How transformers' config class for one `model_type` gives each layer its attention when
    `layer_types` is absent (each config's `__post_init__`, transformers 5):
    - "dense": the model has no sliding window (Llama ignores `sliding_window`);
    - "window": every layer is windowed (Mistral, Ministral);
    - "qwen": with `use_sliding_window` (default false), layers from `max_window_layers`
      (default 28) on are windowed (Qwen2, Qwen3);
    - "qwen2_moe": with `use_sliding_window`, the even layers below `max_window_layers` (28)
      are windowed (Qwen2MoeConfig's own rule);
    - "qwen3_moe": with `use_sliding_window`, every layer is windowed (Qwen3MoeConfig has no
      `layer_types` and its model ignores `max_window_layers`);
    - "pattern": layer l is dense iff (l + 1) % p == 0, p read from `pattern_key` (or fixed).
    `window` is `sliding_window`'s default when the key is absent (null is no window)."""

    layers: str
    window: int | None = None
    pattern: int = 0
    pattern_key: str | None = None


FAMILIES = {
    "llama": Family("dense"),
    "mistral": Family("window", 4096),
    "ministral": Family("window", 4096),
    "qwen2": Family("qwen", 4096),
    "qwen3": Family("qwen", 4096),
    "qwen2_moe": Family("qwen2_moe", 4096),
    "qwen3_moe": Family("qwen3_moe", 4096),
    "gemma2": Family("pattern", 4096, 2),
    "gemma3_text": Family("pattern", 4096, 6, "sliding_window_pattern"),
    "cohere2": Family("pattern", 4096, 4, "sliding_window_pattern"),
    "gpt_oss": Family("pattern", 128, 2),
}
PATTERN_KEYS = ("sliding_window_pattern", "_sliding_window_pattern")


def _int_or_none(cfg: dict[str, Any], key: str, default: int | None, source: str) -> int | None:
    value = _value(cfg, key, default)
    if value is None:
        return None
    return get_int({key: value}, key, minimum=1, source=source, error=SpecError)


def _window(cfg: dict[str, Any], source: str) -> int | None:
    """The window of a config of no known model_type, or None when there is none or
    `use_sliding_window` turns it off."""
    if not get_bool(cfg, "use_sliding_window", True, source=source, error=SpecError):
        return None
    return _int_or_none(cfg, "sliding_window", None, source)


def _typed_kinds(types: Any, window: int | None, num_layers: int, source: str) -> list[int | None]:
    if not isinstance(types, list) or len(types) != num_layers:
        raise SpecError(
            f"{source}: field 'layer_types' must be a list of {num_layers} strings, got {types!r:.80}"
        )
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise SpecError(
                f"{source}: layer_types[{i}] is {t!r:.40}; sparsegen maps only {', '.join(LAYER_TYPES)}"
            )
    return [window if t == "sliding_attention" else None for t in types]


def _generic_kinds(cfg: dict[str, Any], num_layers: int, source: str) -> list[int | None]:
    """A config of no known model_type: `layer_types`, else Qwen2-style `max_window_layers`,
    else `sliding_window_pattern`, else `sliding_window` on every layer."""
    window = _window(cfg, source)
    types = _value(cfg, "layer_types", None)
    if types is not None:
        return _typed_kinds(types, window, num_layers, source)
    if _value(cfg, "use_sliding_window", None) is not None or "max_window_layers" in cfg:
        first = get_int(cfg, "max_window_layers", 0, minimum=0, source=source, error=SpecError)
        return [window if i >= first else None for i in range(num_layers)]
    if "sliding_window_pattern" in cfg:
        p = get_int(cfg, "sliding_window_pattern", minimum=1, source=source, error=SpecError)
        return [None if (i + 1) % p == 0 else window for i in range(num_layers)]
    return [window] * num_layers


def _ignored(cfg: dict[str, Any], key: str, meant: Any, model_type: str, source: str) -> None:
    """A field transformers' config for `model_type` ignores must not say otherwise."""
    if key in cfg and cfg[key] != meant:
        raise SpecError(
            f"{source}: field {key!r} is {cfg[key]!r:.40}, but transformers' {model_type} config ignores it "
            f"(and reads {meant!r}); sparsegen cannot tell which is meant"
        )


def layer_kinds(cfg: dict[str, Any], num_layers: int, source: str) -> list[int | None]:
    """Per layer: the window in keys, or None for dense causal attention, as transformers' config
    class of the `model_type` reads the file (`FAMILIES`; other model types: `_generic_kinds`)."""
    model_type = _value(cfg, "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return _generic_kinds(cfg, num_layers, source)
    if family.layers == "dense":
        return [None] * num_layers
    window = _int_or_none(cfg, "sliding_window", family.window, source)
    qwen = family.layers.startswith("qwen")
    if qwen:
        if not get_bool(cfg, "use_sliding_window", False, source=source, error=SpecError):
            window = None
    elif window is not None and _value(cfg, "use_sliding_window", None) is not None:
        _ignored(cfg, "use_sliding_window", True, model_type, source)  # false would say "no window"
    types = _value(cfg, "layer_types", None)
    if types is not None:
        kinds = _typed_kinds(types, window, num_layers, source)
        if model_type == "mistral" and kinds != [window] * num_layers:  # MistralModel windows every
            raise SpecError(  # layer, while AutoConfig reads the file as Ministral's, layer by layer
                f"{source}: field 'layer_types' disagrees with 'sliding_window' in a mistral config: transformers' "
                "MistralModel ignores it, its AutoConfig reads the file as ministral; sparsegen cannot tell which"
            )
        if family.layers == "qwen3_moe" and kinds != [window] * num_layers:
            raise SpecError(  # Qwen3MoeModel windows every layer or none, whatever the file says
                f"{source}: field 'layer_types' is {types!r:.60}, but transformers' qwen3_moe model ignores it "
                f"(and windows {'every layer' if window else 'no layer'}); sparsegen cannot tell which is meant"
            )
        if family.layers == "qwen2_moe" and window is None and "sliding_attention" in types:
            raise SpecError(  # Qwen2MoeConfig sets sliding_window to 0 then: no key would be seen
                f"{source}: field 'layer_types' has sliding_attention layers, but use_sliding_window is false "
                "(transformers' qwen2_moe config reads a window of 0 keys for them)"
            )
        return kinds
    if family.layers in ("window", "qwen3_moe"):
        return [window] * num_layers
    if qwen:
        first = get_int(cfg, "max_window_layers", 28, minimum=0, source=source, error=SpecError)
        if family.layers == "qwen2_moe":
            return [window if (i + 1) % 2 and i < first else None for i in range(num_layers)]
        return [window if i >= first else None for i in range(num_layers)]
    p = family.pattern
    if family.pattern_key is not None:
        p = get_int(cfg, family.pattern_key, p, minimum=1, source=source, error=SpecError)
    for key in PATTERN_KEYS:
        if key != family.pattern_key:
            _ignored(cfg, key, p, model_type, source)
    return [None if (i + 1) % p == 0 else window for i in range(num_layers)]


def check_blocksparse_alone(cfg: dict[str, Any], source: str, error: type[Exception]) -> None:
    """Phi-3-Small's attention is its blocksparse_* fields: a sliding window or per-layer types
    beside them cannot be honoured, and are refused naming the field."""
    for key in ("sliding_window", "layer_types", "max_window_layers", *PATTERN_KEYS):
        if _value(cfg, key, None) is not None:
            raise error(
                f"{source} has both blocksparse_* fields (Phi-3-Small's attention) and {key!r} = "
                f"{cfg[key]!r:.40}; sparsegen cannot tell how they combine"
            )
    if _value(cfg, "use_sliding_window", None) not in (None, False):
        raise error(
            f"{source} has both blocksparse_* fields and use_sliding_window; sparsegen cannot combine them"
        )


# model types whose transformers modeling never reads `use_bidirectional_attention`: their
# attention is causal whatever the field says (Gemma-2/3's read it and turn causality off)
IGNORE_BIDIRECTIONAL = frozenset(
    ("llama", "mistral", "ministral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "cohere2", "gpt_oss")
)


def check_causal(cfg: dict[str, Any], source: str, error: type[Exception]) -> None:
    """Every sparsegen pattern is causal: a bidirectional model is refused naming the field (a
    family whose transformers model ignores the field runs causal there, and here)."""
    if _value(cfg, "model_type", None) in IGNORE_BIDIRECTIONAL:
        return
    value = _value(cfg, "use_bidirectional_attention", None)
    if value is not None and get_bool(cfg, "use_bidirectional_attention", source=source, error=error):
        raise error(
            f"{source}: field 'use_bidirectional_attention' is true; sparsegen's attention is causal and "
            "cannot serve a bidirectional model"
        )
