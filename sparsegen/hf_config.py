"""Reading an HF `config.json`: exact-typed fields, and each layer's attention pattern.

One parser for both users of a config: `sparsegen.get_pattern` (errors are `SpecError`) and the
Phi-3-Small model loader (errors are `CheckpointError`); the caller passes its error class and
the file's name, and every message starts with that name and names the field.

Per-layer mapping (`model_spec_from_hf`), read as transformers' config class for the
`model_type` reads the file, with its defaults (`FAMILIES`, `layer_kinds`):
1. `blocksparse_*` fields or `model_type` phi3small: Phi-3-Small. Layer l is dense iff
   `(l + 1) % n == 0` with n = `dense_attention_every_n_layers` (absent: HF's default 2; null
   or 0: no dense layer). A sliding window or per-layer types beside them are refused.
2. `layer_types`: `full_attention` is dense causal, `sliding_attention` a window of
   `sliding_window` keys (dense if the window is null or off).
3. Without `layer_types`, the family's rule: Mistral windows every layer (`sliding_window`
   absent: 4096); Qwen2/3 window layers from `max_window_layers` (28) on, only with
   `use_sliding_window`; Gemma-2 and gpt-oss alternate (even layers windowed; windows 4096 and
   128); Gemma-3 and Cohere-2 make layer l dense iff `(l + 1) % p == 0`, p =
   `sliding_window_pattern` (6 and 4); Llama has no window. A field the family's config
   ignores (`_sliding_window_pattern`, Gemma-2's `sliding_window_pattern`) must agree with what
   it reads, and `layer_types` mixing kinds in a mistral file (read one way by MistralModel,
   another by AutoConfig) is refused.
4. Other model types: `layer_types`, else Qwen2-style `max_window_layers`, else
   `sliding_window_pattern`, else `sliding_window` on every layer (absent or null: dense).
`use_bidirectional_attention` true is refused: every spec is causal.
An HF window of W keys is `HeadSpec(sliding_window=W)`: query i sees key j iff i - j < W, as in
HF's masks. Only visibility is mapped: logit soft-capping (Gemma-2) or attention sinks (gpt-oss)
are not part of a spec. The head_dim must be one the kernels serve (64, 96, 128); others are a
`SpecError` naming head_dim, the honest answer until kernels for them exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import SpecError
from .spec import HeadSpec, LayerSpec, ModelSpec

_MISSING = object()


def _value(cfg: dict[str, Any], key: str, default: Any) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else default


def get_int(
    cfg: dict[str, Any],
    key: str,
    default: Any = _MISSING,
    *,
    source: str,
    error: type[Exception],
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """An exact int (not a bool, not 8.0) in minimum..maximum; absent: `default` or an error."""
    value = _value(cfg, key, default)
    if value is _MISSING:
        raise error(f"{source}: field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{source}: field {key!r} must be an int, got {value!r:.80}")
    if minimum is not None and value < minimum:
        raise error(f"{source}: field {key!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{source}: field {key!r} must be <= {maximum}, got {value}")
    return value


def get_float(
    cfg: dict[str, Any],
    key: str,
    default: Any = _MISSING,
    *,
    source: str,
    error: type[Exception],
    positive: bool = False,
    nonnegative: bool = False,
) -> float:
    """A finite number (an int is accepted as a float, a bool is not)."""
    value = _value(cfg, key, default)
    if value is _MISSING:
        raise error(f"{source}: field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{source}: field {key!r} must be a number, got {value!r:.80}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise error(
            f"{source}: field {key!r} must be a finite number, got an int of {value.bit_length()} bits"
        ) from None
    if not math.isfinite(value):
        raise error(f"{source}: field {key!r} must be a finite number, got {value}")
    if positive and value <= 0.0:
        raise error(f"{source}: field {key!r} must be > 0, got {value}")
    if nonnegative and value < 0.0:
        raise error(f"{source}: field {key!r} must be >= 0, got {value}")
    return value


def get_bool(
    cfg: dict[str, Any], key: str, default: Any = _MISSING, *, source: str, error: type[Exception]
) -> bool:
    """An exact JSON true/false: "false", 0 and null are refused, never read as truthiness."""
    value = _value(cfg, key, default)
    if value is _MISSING:
        raise error(f"{source}: field {key!r} is missing")
    if not isinstance(value, bool):
        raise error(f"{source}: field {key!r} must be true or false, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class BlocksparseFields:
    """Phi-3-Small's attention fields, with HF `Phi3SmallConfig`'s defaults when absent."""

    block_size: int = 64
    local_blocks: int = 16
    vert_stride: int = 8
    homo_head: bool = False
    dense_every: int = 2  # layer l is dense iff dense_every and (l + 1) % dense_every == 0


def blocksparse_fields(cfg: dict[str, Any], source: str, error: type[Exception]) -> BlocksparseFields:
    """The one reader of `blocksparse_*` and `dense_attention_every_n_layers` (pattern and model)."""
    d = BlocksparseFields()
    kw = {"source": source, "error": error}
    every = _value(cfg, "dense_attention_every_n_layers", d.dense_every)
    every = 0 if every is None else every  # HF: a null count means no dense layer
    return BlocksparseFields(
        block_size=get_int(cfg, "blocksparse_block_size", d.block_size, minimum=1, **kw),
        local_blocks=get_int(cfg, "blocksparse_num_local_blocks", d.local_blocks, minimum=0, **kw),
        vert_stride=get_int(cfg, "blocksparse_vert_stride", d.vert_stride, minimum=0, **kw),
        homo_head=get_bool(cfg, "blocksparse_homo_head_pattern", d.homo_head, **kw),
        dense_every=get_int({"dense_attention_every_n_layers": every}, "dense_attention_every_n_layers",
                            minimum=0, **kw),
    )  # fmt: skip


def phi3small_heads(num_heads: int, fields: BlocksparseFields) -> tuple[HeadSpec, ...]:
    from .presets import blocksparse_heads  # presets imports this module

    return blocksparse_heads(
        num_heads,
        block_size=fields.block_size,
        local_blocks=fields.local_blocks,
        vert_stride=fields.vert_stride,
        homo_head=fields.homo_head,
    )


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int


def attention_shape(cfg: dict[str, Any], source: str, error: type[Exception]) -> AttentionShape:
    kw = {"source": source, "error": error}
    num_heads = get_int(cfg, "num_attention_heads", minimum=1, **kw)
    num_kv = _value(cfg, "num_key_value_heads", None)
    num_kv = num_heads if num_kv is None else get_int(cfg, "num_key_value_heads", minimum=1, **kw)
    num_layers = get_int(cfg, "num_hidden_layers", minimum=1, maximum=100_000, **kw)
    if num_heads % num_kv:
        raise error(
            f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}"
        )
    if _value(cfg, "head_dim", None) is not None:
        head_dim = get_int(cfg, "head_dim", minimum=1, **kw)
    else:
        hidden = get_int(cfg, "hidden_size", minimum=1, **kw)
        if hidden % num_heads:
            raise error(f"{source}: hidden_size {hidden} is not a multiple of {num_heads} heads")
        head_dim = hidden // num_heads
    return AttentionShape(num_heads, num_kv, head_dim, num_layers)


LAYER_TYPES = ("full_attention", "sliding_attention")
QWEN_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Family:
    """How transformers' config class for one `model_type` gives each layer its attention when
    `layer_types` is absent (each config's `__post_init__`, transformers 5):
    - "dense": the model has no sliding window (Llama ignores `sliding_window`);
    - "window": every layer is windowed (Mistral, Ministral);
    - "qwen": with `use_sliding_window` (default false), layers from `max_window_layers`
      (default 28) on are windowed;
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
    **{t: Family("qwen", 4096) for t in QWEN_MODEL_TYPES},
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
    if family.layers == "qwen":
        if not get_bool(cfg, "use_sliding_window", False, source=source, error=SpecError):
            window = None
    elif window is not None and _value(cfg, "use_sliding_window", None) is not None:
        _ignored(cfg, "use_sliding_window", True, model_type, source)  # false would say "no window"
    types = _value(cfg, "layer_types", None)
    if types is not None:
        kinds = _typed_kinds(types, window, num_layers, source)
        if model_type == "mistral" and len(set(kinds)) > 1:  # MistralModel windows every layer,
            raise SpecError(  # while AutoConfig reads the file as Ministral's, layer by layer
                f"{source}: field 'layer_types' mixes layer kinds in a mistral config: transformers' "
                "MistralModel ignores it, its AutoConfig reads the file as ministral; sparsegen cannot tell which"
            )
        return kinds
    if family.layers == "window":
        return [window] * num_layers
    if family.layers == "qwen":
        first = get_int(cfg, "max_window_layers", 28, minimum=0, source=source, error=SpecError)
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


def check_causal(cfg: dict[str, Any], source: str, error: type[Exception]) -> None:
    """Every sparsegen pattern is causal: a bidirectional model is refused naming the field."""
    value = _value(cfg, "use_bidirectional_attention", None)
    if value is not None and get_bool(cfg, "use_bidirectional_attention", source=source, error=error):
        raise error(
            f"{source}: field 'use_bidirectional_attention' is true; sparsegen's attention is causal and "
            "cannot serve a bidirectional model"
        )


def model_spec_from_hf(
    cfg: dict[str, Any], name: str = "hf-config", source: str = "config.json"
) -> ModelSpec:
    """Each layer's LayerSpec from an HF config dict; every error is a SpecError naming `source`."""
    if not isinstance(cfg, dict):
        raise SpecError(f"{source} must hold a JSON object, got {type(cfg).__name__}")
    try:
        return _model_spec(cfg, name, source)
    except SpecError as exc:
        if str(exc).startswith(source):
            raise
        raise SpecError(f"{source}: {exc}") from None


def _model_spec(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    shape = attention_shape(cfg, source, SpecError)
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    dense = LayerSpec(h, hkv, d, (HeadSpec(dense=True),) * h)
    check_causal(cfg, source, SpecError)
    if _value(cfg, "model_type", None) == "phi3small" or any(k.startswith("blocksparse_") for k in cfg):
        check_blocksparse_alone(cfg, source, SpecError)
        fields = blocksparse_fields(cfg, source, SpecError)
        try:
            heads = phi3small_heads(h, fields)
        except SpecError as exc:
            raise SpecError(
                f"{source}: blocksparse_block_size={fields.block_size}, blocksparse_num_local_blocks="
                f"{fields.local_blocks}, blocksparse_vert_stride={fields.vert_stride} give heads "
                f"sparsegen cannot serve: {exc}"
            ) from None
        sparse = LayerSpec(h, hkv, d, heads)
        every = fields.dense_every
        layers = [dense if every and (i + 1) % every == 0 else sparse for i in range(shape.num_layers)]
        return ModelSpec(name, tuple(layers))
    windows: dict[int, LayerSpec] = {}
    layers = []
    for w in layer_kinds(cfg, shape.num_layers, source):
        if w is None:
            layers.append(dense)
        else:
            if w not in windows:
                windows[w] = LayerSpec(h, hkv, d, (HeadSpec(sliding_window=w),) * h)
            layers.append(windows[w])
    return ModelSpec(name, tuple(layers))
