"""Reading an HF `config.json`: exact-typed fields, and each layer's attention pattern.

One parser for both users of a config: `sparsegen.get_pattern` (errors are `SpecError`) and the
Phi-3-Small model loader (errors are `CheckpointError`); the caller passes its error class and
the file's name, and every message starts with that name and names the field.

Per-layer mapping (`model_spec_from_hf`), first rule that applies:
1. `blocksparse_*` fields: Phi-3-Small. Layer l is dense iff `(l + 1) % n == 0` with
   n = `dense_attention_every_n_layers` (absent: HF's default 2; null or 0: no dense layer).
2. `layer_types` (Qwen3, gpt-oss, newer HF files): `full_attention` is dense causal,
   `sliding_attention` a window of `sliding_window` keys (dense if the window is null/off).
3. Qwen2-style `use_sliding_window` + `max_window_layers`: the first `max_window_layers` layers
   are dense, later ones windowed; all dense when `use_sliding_window` is false.
4. Gemma-2 (`model_type` gemma2) without `layer_types`: even layers windowed, odd ones dense;
   `sliding_window_pattern` p (Gemma-3, Cohere-2): layer l is dense iff `(l + 1) % p == 0`.
5. Otherwise `sliding_window` (Mistral) windows every layer; absent or null: dense.
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


def phi3small_heads(num_heads: int, fields: BlocksparseFields) -> tuple[HeadSpec, ...]:
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


def _window(cfg: dict[str, Any], source: str) -> int | None:
    """The configured window, or None when there is none or `use_sliding_window` turns it off
    (absent, it is off for Qwen models, as in HF's Qwen2Config/Qwen3Config, and on elsewhere)."""
    on_by_default = _value(cfg, "model_type", None) not in QWEN_MODEL_TYPES
    if not get_bool(cfg, "use_sliding_window", on_by_default, source=source, error=SpecError):
        return None
    if _value(cfg, "sliding_window", None) is None:
        return None
    return get_int(cfg, "sliding_window", minimum=1, source=source, error=SpecError)


def layer_kinds(cfg: dict[str, Any], num_layers: int, source: str) -> list[int | None]:
    """Per layer: the window in keys, or None for dense causal attention (rules 2-5 above)."""
    window = _window(cfg, source)
    types = _value(cfg, "layer_types", None)
    if types is not None:
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
    model_type = _value(cfg, "model_type", None)
    if _value(cfg, "use_sliding_window", None) is not None or "max_window_layers" in cfg:
        default = 28 if model_type in QWEN_MODEL_TYPES else 0  # HF Qwen2Config/Qwen3Config default
        first = get_int(cfg, "max_window_layers", default, minimum=0, source=source, error=SpecError)
        return [window if i >= first else None for i in range(num_layers)]
    if "sliding_window_pattern" in cfg:
        p = get_int(cfg, "sliding_window_pattern", minimum=1, source=source, error=SpecError)
        return [None if (i + 1) % p == 0 else window for i in range(num_layers)]
    if model_type == "gemma2":
        return [window if i % 2 == 0 else None for i in range(num_layers)]
    return [window] * num_layers


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
    if any(k.startswith("blocksparse_") for k in cfg):
        if _window(cfg, source) or "layer_types" in cfg or "max_window_layers" in cfg:
            raise SpecError(
                f"{source} has both blocksparse_* fields and a sliding window or per-layer types "
                "(sliding_window/layer_types/max_window_layers); sparsegen cannot tell how they combine"
            )
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
