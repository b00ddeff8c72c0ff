"""Phi-3-Small's configuration, read from an HF `config.json` (DESIGN §2), and named sizes.

`Phi3SmallConfig` is frozen; `from_hf_dict` reads every field the forward pass depends on and
refuses values it cannot honour, naming the field. `named_config("tiny" | "7b")` builds the
random-weight sizes used by tests, demos and the GPU benchmark.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import jsonio
from ..errors import CheckpointError, SpecError
from ..hf_config import (
    blocksparse_fields,
    check_blocksparse_alone,
    check_causal,
    get_bool,
    get_float,
    get_int,
    model_spec_from_hf,
)
from ..spec import MAX_SEQ_LEN
from .config_dtype import config_dtype


@dataclass(frozen=True)
class LongRopeConfig:
    """LongRoPE (the 128k model): per-frequency rescale factors and cos/sin multipliers."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    short_mscale: float
    long_mscale: float


@dataclass(frozen=True)
class Phi3SmallConfig:
    vocab_size: int = 100352
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    ff_intermediate_size: int = 14336
    layer_norm_epsilon: float = 1e-5
    gegelu_limit: float = 20.0
    max_position_embeddings: int = 8192
    rope_embedding_base: float = 1e6
    rope_position_scale: float = 1.0
    rope_scaling: LongRopeConfig | None = None
    mup_attn_multiplier: float = 1.0
    mup_embedding_multiplier: float = 10.0
    mup_width_multiplier: float = 8.0
    mup_use_scaling: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int = 100257
    eos_token_id: int = 100257
    dummy_token_indices: tuple[int, ...] | None = None  # None: ask the tokenizer
    blocksparse_block_size: int = 64
    blocksparse_num_local_blocks: int = 16
    blocksparse_vert_stride: int = 8
    blocksparse_homo_head_pattern: bool = False
    dense_attention_every_n_layers: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G): the fused QKV is viewed as (..., Hkv, G + 2, D)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        """μP: 1 / (head_dim / mup_attn_multiplier) = 1/128 for Phi-3-Small; else 1/sqrt(d)."""
        if self.mup_use_scaling:
            return self.mup_attn_multiplier / self.head_dim
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> Phi3SmallConfig:
        return _from_hf_dict(cls, cfg, source)

    @classmethod
    def from_file(cls, path: str | Path) -> Phi3SmallConfig:
        return cls.from_hf_dict(read_config_json(path), str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config.json dict that `from_hf_dict` reads back to an equal config."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rope_scaling", "dummy_token_indices")}
        out.update(
            model_type="phi3small",
            architectures=["Phi3SmallForCausalLM"],
            hidden_act="gegelu",
            blocksparse_triton_kernel_block_size=self.blocksparse_block_size,
            rope_scaling=None,
        )
        if self.dummy_token_indices is not None:
            out["dummy_token_indices"] = list(self.dummy_token_indices)
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            out["rope_scaling"] = {
                "type": "longrope",
                "short_factor": list(rs.short_factor),
                "long_factor": list(rs.long_factor),
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "short_mscale": rs.short_mscale,
                "long_mscale": rs.long_mscale,
            }
        return out


def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; a checkpoint folder needs a config.json")
    data = jsonio.read_json_file(path, CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


# Bounds on sizes: beyond them a config is a mistake (or an attack on memory), not a model.
MAX_VOCAB = 2**24
MAX_WIDTH = 2**17  # hidden_size and ff_intermediate_size
MAX_LAYERS = 1024


def _intermediate_size(cfg: dict[str, Any], hidden: int, source: str) -> int:
    kw = {"source": source, "error": CheckpointError}
    if cfg.get("ff_intermediate_size") is not None:
        return get_int(cfg, "ff_intermediate_size", minimum=1, maximum=MAX_WIDTH, **kw)
    multiplier = 4.0
    if cfg.get("ff_dim_multiplier") is not None:
        multiplier = get_float(cfg, "ff_dim_multiplier", positive=True, **kw)
    size = int(hidden * multiplier)
    if get_bool(cfg, "gegelu_pad_to_256", True, **kw):
        size = -(-size // 256) * 256
    if not 1 <= size <= MAX_WIDTH:
        raise CheckpointError(
            f"{source}: ff_dim_multiplier {multiplier} gives an intermediate size of {size}"
        )
    return size


def default_mscale(max_positions: int, original: int) -> float:
    """HF's LongRoPE default when an mscale is absent: sqrt(1 + ln(s) / ln(original)), s > 1."""
    scale = max_positions / original
    if scale <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(scale) / math.log(original))


def _long_rope(cfg: dict[str, Any], head_dim: int, max_positions: int, source: str) -> LongRopeConfig | None:
    rs = cfg.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise CheckpointError(f"{source}: field 'rope_scaling' must be an object or null, got {rs!r:.80}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind not in ("longrope", "su"):
        raise CheckpointError(
            f"{source}: rope_scaling type {kind!r:.40} is not supported (only 'longrope'/'su')"
        )
    factors = {}
    for name in ("short_factor", "long_factor"):
        f = rs.get(name)
        if not isinstance(f, list) or len(f) != head_dim // 2:
            raise CheckpointError(
                f"{source}: rope_scaling.{name} must be a list of {head_dim // 2} numbers, got {f!r:.80}"
            )
        where = f"{source}: rope_scaling"
        factors[name] = tuple(
            get_float({f"{name}[{i}]": x}, f"{name}[{i}]", source=where, error=CheckpointError, positive=True)
            for i, x in enumerate(f)
        )
    original = rs.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= max_positions:
        raise CheckpointError(
            f"{source}: rope_scaling needs an int original_max_position_embeddings in 1..{max_positions} "
            f"(max_position_embeddings), got {original!r:.40}"
        )
    fallback = default_mscale(max_positions, original)
    mscales = {}
    for name in ("short_mscale", "long_mscale"):
        value = rs.get(name)
        mscales[name] = fallback if value is None else get_float(
            rs, name, source=f"{source}: rope_scaling", error=CheckpointError, positive=True
        )  # fmt: skip
    return LongRopeConfig(original_max_position_embeddings=original, **factors, **mscales)


def _token_id(cfg: dict[str, Any], key: str, default: int, vocab: int, source: str) -> int:
    value = cfg.get(key, default)
    if isinstance(value, list) and key == "eos_token_id":  # some configs list several; the first is the EOS
        if not value:
            raise CheckpointError(f"{source}: field 'eos_token_id' is an empty list")
        for i, v in enumerate(value):
            get_int({f"eos_token_id[{i}]": v}, f"eos_token_id[{i}]", source=source, error=CheckpointError,
                    minimum=0, maximum=vocab - 1)  # fmt: skip
        value = value[0]
    return get_int({key: value}, key, source=source, error=CheckpointError, minimum=0, maximum=vocab - 1)


def _from_hf_dict(cls: type, cfg: dict[str, Any], source: str) -> Phi3SmallConfig:
    """Every field is checked for its exact type and range; each error names `source` and the field."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source} must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type", "phi3small")
    if model_type != "phi3small":
        raise CheckpointError(
            f"{source}: model_type is {model_type!r:.40}; this loader reads Phi-3-Small ('phi3small') only"
        )
    config_dtype(cfg, source)  # a dtype transformers would not load, or sparsegen cannot honour
    act = cfg.get("hidden_act", "gegelu")
    if act != "gegelu":
        raise CheckpointError(
            f"{source}: field 'hidden_act' must be 'gegelu' (Phi-3-Small's), got {act!r:.40}"
        )
    d = cls()
    kw = {"source": source, "error": CheckpointError}
    i = lambda key, **b: get_int(cfg, key, getattr(d, key), **kw, **b)  # noqa: E731
    f = lambda key, **b: get_float(cfg, key, getattr(d, key), **kw, **b)  # noqa: E731
    b = lambda key: get_bool(cfg, key, getattr(d, key), **kw)  # noqa: E731
    vocab = i("vocab_size", minimum=1, maximum=MAX_VOCAB)
    hidden = i("hidden_size", minimum=1, maximum=MAX_WIDTH)
    heads = i("num_attention_heads", minimum=1)
    kv_heads = i("num_key_value_heads", minimum=1)
    if hidden % heads or heads % kv_heads:
        raise CheckpointError(
            f"{source}: hidden_size {hidden}, num_attention_heads {heads} and num_key_value_heads "
            f"{kv_heads} must divide evenly"
        )
    if (hidden // heads) % 2:
        raise CheckpointError(f"{source}: head_dim {hidden // heads} must be even for rotary embeddings")
    max_positions = i("max_position_embeddings", minimum=1, maximum=MAX_SEQ_LEN)
    dummy = cfg.get("dummy_token_indices")
    if dummy is not None:
        if not isinstance(dummy, list):
            raise CheckpointError(
                f"{source}: field 'dummy_token_indices' must be a list of ints, got {dummy!r:.80}"
            )
        dummy = tuple(
            get_int({f"dummy_token_indices[{n}]": x}, f"dummy_token_indices[{n}]", minimum=0, maximum=vocab - 1, **kw)
            for n, x in enumerate(dummy)
        )  # fmt: skip
    sparse = blocksparse_fields(cfg, source, CheckpointError)
    check_blocksparse_alone(cfg, source, CheckpointError)  # a window beside them is never dropped silently
    check_causal(cfg, source, CheckpointError)
    config = cls(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=i("num_hidden_layers", minimum=1, maximum=MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        ff_intermediate_size=_intermediate_size(cfg, hidden, source),
        layer_norm_epsilon=f("layer_norm_epsilon", positive=True),
        gegelu_limit=f("gegelu_limit", positive=True),
        max_position_embeddings=max_positions,
        rope_embedding_base=f("rope_embedding_base", positive=True),
        rope_position_scale=f("rope_position_scale", positive=True),
        rope_scaling=_long_rope(cfg, hidden // heads, max_positions, source),
        mup_attn_multiplier=f("mup_attn_multiplier", positive=True),
        mup_embedding_multiplier=f("mup_embedding_multiplier", positive=True),
        mup_width_multiplier=f("mup_width_multiplier", positive=True),
        mup_use_scaling=b("mup_use_scaling"),
        tie_word_embeddings=b("tie_word_embeddings"),
        bos_token_id=_token_id(cfg, "bos_token_id", d.bos_token_id, vocab, source),
        eos_token_id=_token_id(cfg, "eos_token_id", d.eos_token_id, vocab, source),
        dummy_token_indices=dummy,
        blocksparse_block_size=sparse.block_size,
        blocksparse_num_local_blocks=sparse.local_blocks,
        blocksparse_vert_stride=sparse.vert_stride,
        blocksparse_homo_head_pattern=sparse.homo_head,
        dense_attention_every_n_layers=sparse.dense_every,
    )
    try:  # the attention pattern, through the same parser as sparsegen.get_pattern
        model_spec_from_hf(config.to_hf_dict(), name="phi3small", source=source)
    except SpecError as exc:
        raise CheckpointError(f"sparsegen cannot serve this model's attention: {exc}") from None
    return config


# Byte-level vocabulary of the `tiny` size: ids 0..255 are bytes, then special tokens, then
# dummies (masked out of the logits), padded to a multiple of 16.
TINY_SPECIAL_TOKENS = {
    "<|endoftext|>": 256,
    "<|system|>": 257,
    "<|user|>": 258,
    "<|assistant|>": 259,
    "<|end|>": 260,
}
TINY_VOCAB_SIZE = 272


def named_config(name: str) -> Phi3SmallConfig:
    """Random-weight sizes: `tiny` (CPU tests and demos), `7b` (Phi-3-Small's real shape, 128k)."""
    if name == "tiny":
        return Phi3SmallConfig(
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            ff_intermediate_size=512,
            max_position_embeddings=4096,
            rope_embedding_base=10000.0,
            bos_token_id=256,
            eos_token_id=256,
            dummy_token_indices=tuple(range(261, TINY_VOCAB_SIZE)),
            blocksparse_block_size=16,
            blocksparse_num_local_blocks=2,
            blocksparse_vert_stride=4,
        )
    if name == "7b":
        # The 128k variant, so that 32K-token prompts are in range; unit LongRoPE factors.
        half = 64
        return Phi3SmallConfig(
            max_position_embeddings=131072,
            rope_scaling=LongRopeConfig(
                short_factor=(1.0,) * half,
                long_factor=(1.0,) * half,
                original_max_position_embeddings=8192,
                short_mscale=1.0,
                long_mscale=default_mscale(131072, 8192),
            ),
        )
    raise CheckpointError(f"unknown model size {name!r}; expected one of {NAMED_SIZES}")


NAMED_SIZES = ("tiny", "7b")

__all__ = [
    "CheckpointError",
    "LongRopeConfig",
    "NAMED_SIZES",
    "Phi3SmallConfig",
    "named_config",
    "read_config_json",
]
