"""Phi-3-Small's configuration, read from an HF `config.json` (DESIGN §2), and named sizes.

`Phi3SmallConfig` is frozen; `from_hf_dict` reads every field the forward pass depends on and
refuses values it cannot honour, naming the field. `named_config("tiny" | "7b")` builds the
random-weight sizes used by tests, demos and the GPU benchmark.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError


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
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _field(cfg: dict[str, Any], key: str, kind: type, default: Any, source: str) -> Any:
    value = cfg.get(key, default)
    if value is None and default is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise CheckpointError(f"{source}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _intermediate_size(cfg: dict[str, Any], hidden: int, source: str) -> int:
    size = _field(cfg, "ff_intermediate_size", int, None, source)
    if size is not None:
        return size
    multiplier = _field(cfg, "ff_dim_multiplier", float, None, source) or 4.0
    size = int(hidden * multiplier)
    if cfg.get("gegelu_pad_to_256", True):
        size = -(-size // 256) * 256
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
        raise CheckpointError(f"{source}: field 'rope_scaling' must be an object or null, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind not in ("longrope", "su"):
        raise CheckpointError(f"{source}: rope_scaling type {kind!r} is not supported (only 'longrope'/'su')")
    factors = {}
    for name in ("short_factor", "long_factor"):
        f = rs.get(name)
        if (
            not isinstance(f, list)
            or len(f) != head_dim // 2
            or not all(isinstance(x, (int, float)) for x in f)
        ):
            raise CheckpointError(
                f"{source}: rope_scaling.{name} must be a list of {head_dim // 2} numbers, got {f!r}"
            )
        factors[name] = tuple(float(x) for x in f)
    original = rs.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise CheckpointError(
            f"{source}: rope_scaling needs an int original_max_position_embeddings, got {original!r}"
        )
    fallback = default_mscale(max_positions, original)
    mscales = {}
    for name in ("short_mscale", "long_mscale"):
        m = rs.get(name)
        if m is None:
            m = fallback
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise CheckpointError(f"{source}: rope_scaling.{name} must be a number, got {m!r}")
        mscales[name] = float(m)
    return LongRopeConfig(original_max_position_embeddings=original, **factors, **mscales)


def _from_hf_dict(cls: type, cfg: dict[str, Any], source: str) -> Phi3SmallConfig:
    d = cls()
    f = lambda key, kind: _field(cfg, key, kind, getattr(d, key), source)  # noqa: E731
    hidden = f("hidden_size", int)
    heads = f("num_attention_heads", int)
    kv_heads = f("num_key_value_heads", int)
    if heads < 1 or kv_heads < 1 or hidden % heads or heads % kv_heads:
        raise CheckpointError(
            f"{source}: hidden_size {hidden}, num_attention_heads {heads} and num_key_value_heads "
            f"{kv_heads} must divide evenly"
        )
    max_positions = f("max_position_embeddings", int)
    dummy = cfg.get("dummy_token_indices")
    if dummy is not None:
        if not isinstance(dummy, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dummy
        ):
            raise CheckpointError(f"{source}: field 'dummy_token_indices' must be a list of ints")
        dummy = tuple(dummy)
    eos = cfg.get("eos_token_id", d.eos_token_id)
    if isinstance(eos, list) and eos:  # some configs list several; the first is the EOS
        eos = eos[0]
    config = cls(
        vocab_size=f("vocab_size", int),
        hidden_size=hidden,
        num_hidden_layers=f("num_hidden_layers", int),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        ff_intermediate_size=_intermediate_size(cfg, hidden, source),
        layer_norm_epsilon=f("layer_norm_epsilon", float),
        gegelu_limit=f("gegelu_limit", float),
        max_position_embeddings=max_positions,
        rope_embedding_base=f("rope_embedding_base", float),
        rope_position_scale=f("rope_position_scale", float),
        rope_scaling=_long_rope(cfg, hidden // heads, max_positions, source),
        mup_attn_multiplier=f("mup_attn_multiplier", float),
        mup_embedding_multiplier=f("mup_embedding_multiplier", float),
        mup_width_multiplier=f("mup_width_multiplier", float),
        mup_use_scaling=f("mup_use_scaling", bool),
        tie_word_embeddings=f("tie_word_embeddings", bool),
        bos_token_id=_field(cfg, "bos_token_id", int, d.bos_token_id, source),
        eos_token_id=_field({"eos_token_id": eos}, "eos_token_id", int, d.eos_token_id, source),
        dummy_token_indices=dummy,
        blocksparse_block_size=f("blocksparse_block_size", int),
        blocksparse_num_local_blocks=f("blocksparse_num_local_blocks", int),
        blocksparse_vert_stride=f("blocksparse_vert_stride", int),
        blocksparse_homo_head_pattern=f("blocksparse_homo_head_pattern", bool),
        dense_attention_every_n_layers=f("dense_attention_every_n_layers", int),
    )
    if config.head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {config.head_dim} must be even for rotary embeddings")
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
