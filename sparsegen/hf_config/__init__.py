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
   absent: 4096); Qwen2/3 window layers from `max_window_layers` (28) on, Qwen2-MoE the even
   layers below it, Qwen3-MoE every layer, only with `use_sliding_window`; Gemma-2 and gpt-oss alternate (even layers windowed; windows 4096 and
   128); Gemma-3 and Cohere-2 make layer l dense iff `(l + 1) % p == 0`, p =
   `sliding_window_pattern` (6 and 4); Llama has no window. A field the family's config
   ignores (`_sliding_window_pattern`, Gemma-2's `sliding_window_pattern`) must agree with what
   it reads, and `layer_types` mixing kinds in a mistral file (read one way by MistralModel,
   another by AutoConfig) is refused.
4. Other model types: `layer_types`, else Qwen2-style `max_window_layers`, else
   `sliding_window_pattern`, else `sliding_window` on every layer (absent or null: dense).
`use_bidirectional_attention` true is refused (every spec is causal) where transformers' model
reads it (Gemma-2/3, unknown types); the families whose model ignores it (`IGNORE_BIDIRECTIONAL`)
run causal there and here.
An HF window of W keys is `HeadSpec(sliding_window=W)`: query i sees key j iff i - j < W, as in
HF's masks. Every layer also carries the model's soft-cap, learned sinks and softmax scale
(`features.layer_features`: Gemma-2/3's `attn_logit_softcapping` and `query_pre_attn_scalar`,
gpt-oss's sinks); a field that cannot be honoured is a SpecError naming it. The head_dim is
the file's, else the config class's default (Gemma: 256), else hidden_size / heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SpecError
from ..spec import HeadSpec, LayerSpec, ModelSpec
from .families import FAMILIES, check_blocksparse_alone, check_causal, layer_kinds  # noqa: F401 - re-exported
from .features import default_head_dim, layer_features
from .fields import _value, get_bool, get_float, get_int  # noqa: F401 - re-exported


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
    elif default_head_dim(cfg) is not None:
        head_dim = default_head_dim(cfg)
    else:
        hidden = get_int(cfg, "hidden_size", minimum=1, **kw)
        if hidden % num_heads:
            raise error(f"{source}: hidden_size {hidden} is not a multiple of {num_heads} heads")
        head_dim = hidden // num_heads
    return AttentionShape(num_heads, num_kv, head_dim, num_layers)


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
    extra = layer_features(cfg, source).kwargs()
    dense = LayerSpec(h, hkv, d, (HeadSpec(dense=True),) * h, **extra)
    windows: dict[int, LayerSpec] = {}
    layers = []
    for w in layer_kinds(cfg, shape.num_layers, source):
        if w is None:
            layers.append(dense)
        else:
            if w not in windows:
                windows[w] = LayerSpec(h, hkv, d, (HeadSpec(sliding_window=w),) * h, **extra)
            layers.append(windows[w])
    return ModelSpec(name, tuple(layers))
