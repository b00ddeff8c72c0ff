"""Attention sparsity specs: which keys each query head may see.

A `HeadSpec` describes one head, a `LayerSpec` one attention layer (its heads plus the
shapes shared by them), a `ModelSpec` a whole model. All three are frozen dataclasses with a
canonical JSON form and a stable SHA-256 `digest()`; the digest, never `hash()`, is what
cache keys are built from.

Semantics (DESIGN §1): query i sees key j iff j <= i and any enabled part allows it:
  dense            always
  local blocks     i//B - j//B < local_blocks
  vertical stride  (j//B + vert_offset + 1) % vert_stride == 0
  sliding window   i - j < sliding_window
  sink tokens      j < sink_tokens (StreamingLLM's attention sinks)
A layer may also soft-cap its scores (`logit_softcap`: s -> c * tanh(s / c)), add one learned
sink logit per head to the softmax denominator (`learned_sinks`: the kernels then take
`sinks=`), and carry its own default softmax scale (`scale`). Fields at their defaults are left
out of the canonical JSON, so a spec that does not use them keeps its digest.

Bounds (every value is checked here, so none reaches a template unchecked): no kernel serves a
sequence longer than MAX_SEQ_LEN tokens, so a spec is only ever evaluated at positions below it.
  local_blocks     above MAX_SEQ_LEN // block_size it is clamped to that: every causal key is
                   already inside the local blocks there, so the two are the same pattern.
  sliding_window   above MAX_SEQ_LEN it is clamped to MAX_SEQ_LEN, for the same reason.
  sink_tokens      the same clamp; a dense head's sink tokens are 0 (it sees them anyway).
  vert_stride      above MAX_SEQ_LEN // block_size it is refused (SpecError): such a stride picks
                   at most one block of the longest sequence, which no real pattern means.
  vert_offset      below vert_stride (refused otherwise).
  block_size       a power of two in MIN_BLOCK_SIZE..MAX_BLOCK_SIZE (refused otherwise).
  num_heads        at most MAX_HEADS (refused otherwise); head_dim one of SUPPORTED_HEAD_DIMS.
  logit_softcap    0 (off) or in MIN_SOFTCAP..MAX_SOFTCAP; scale None or in MIN_SCALE..MAX_SCALE.
Sizes are exact ints: bools, floats (even 8.0), strings and numpy scalars are refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from . import jsonio
from .errors import SpecError

SPEC_FORMAT = "sparsegen.spec/1"
SUPPORTED_HEAD_DIMS = tuple(range(32, 257, 16))  # every multiple of 16 from 32 to 256
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256
# The longest sequence any kernel serves, in tokens (decode's split arithmetic stays within 32
# bits below it). The one definition: launchers and layout import it from here.
MAX_SEQ_LEN = 2**23
MAX_HEADS = 1024  # query heads per layer; the largest published models have 128
# The kernels multiply raw scores by scale * log2(e) in fp32 before exp2; outside this range that
# factor is inf (every row NaN) or flushes to zero / a subnormal (every row uniform, scale lost).
LOG2E = 1.4426950408889634
FP32_MAX = 3.4028234663852886e38
FP32_MIN_NORMAL = 1.1754943508222875e-38
MAX_SCALE = FP32_MAX / LOG2E  # ~2.36e38
MIN_SCALE = FP32_MIN_NORMAL / LOG2E  # ~8.15e-39
# Soft-cap c: the kernels compute c * tanh(s * (1/c)) in fp32; published models use 30 and 50.
MIN_SOFTCAP, MAX_SOFTCAP = 1e-3, 1e6


def _check_int(owner: str, name: str, value: Any, minimum: int = 0) -> None:
    # bool is an int subclass; reject it so `local_blocks=True` is not silently 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise SpecError(f"{owner}.{name} must be >= {minimum}, got {value!r}")


def _real(value: Any) -> float | None:
    """value as a finite float, or None when it is not a real number (bools and strings are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        value = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return value if math.isfinite(value) else None


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class HeadSpec:
    """One query head's pattern: the union of its enabled parts, always causal."""

    block_size: int = 64
    local_blocks: int = 0
    vert_stride: int = 0
    vert_offset: int = 0
    sliding_window: int = 0
    dense: bool = False
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "local_blocks",
            "vert_stride",
            "vert_offset",
            "sliding_window",
            "sink_tokens",
        ):
            _check_int("HeadSpec", name, getattr(self, name))
        if not isinstance(self.dense, bool):
            raise SpecError(f"HeadSpec.dense must be a bool, got {self.dense!r}")
        bs = self.block_size
        if bs < MIN_BLOCK_SIZE or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
            raise SpecError(
                f"HeadSpec.block_size must be a power of two in "
                f"{MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, got {bs!r}"
            )
        max_blocks = MAX_SEQ_LEN // bs  # blocks of the longest sequence
        if self.vert_stride > max_blocks:
            raise SpecError(
                f"HeadSpec.vert_stride must be <= {max_blocks} (the blocks of a {MAX_SEQ_LEN}-token "
                f"sequence at block_size {bs}), got {self.vert_stride!r}"
            )
        # Beyond these, every causal key within MAX_SEQ_LEN is visible anyway: the same pattern.
        if self.local_blocks > max_blocks:
            object.__setattr__(self, "local_blocks", max_blocks)
        if self.sliding_window > MAX_SEQ_LEN:
            object.__setattr__(self, "sliding_window", MAX_SEQ_LEN)
        if self.sink_tokens > MAX_SEQ_LEN:
            object.__setattr__(self, "sink_tokens", MAX_SEQ_LEN)
        if self.dense:  # a dense head sees every causal key already
            object.__setattr__(self, "sink_tokens", 0)
        if self.vert_stride == 0 and self.vert_offset != 0:
            raise SpecError(f"HeadSpec.vert_offset must be 0 when vert_stride is 0, got {self.vert_offset!r}")
        if self.vert_stride > 0 and self.vert_offset >= self.vert_stride:
            raise SpecError(
                f"HeadSpec.vert_offset must be < vert_stride ({self.vert_stride}), got {self.vert_offset!r}"
            )
        if not (self.dense or self.local_blocks >= 1 or self.sliding_window >= 1):
            raise SpecError(
                "HeadSpec cannot see its own position: set dense=True, local_blocks >= 1 or "
                f"sliding_window >= 1 (got local_blocks={self.local_blocks}, "
                f"sliding_window={self.sliding_window}, dense={self.dense})"
            )

    @property
    def kind(self) -> str:
        """The pattern kind, e.g. 'dense', 'local+vert', 'window', 'window+sink'."""
        if self.dense:
            return "dense"
        parts = []
        if self.local_blocks:
            parts.append("local")
        if self.vert_stride:
            parts.append("vert")
        if self.sliding_window:
            parts.append("window")
        if self.sink_tokens:
            parts.append("sink")
        return "+".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.sink_tokens:  # left out at its default: older specs keep their digests
            del data["sink_tokens"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadSpec:
        return cls(**_known_keys(cls, data, "head"))

    def digest(self) -> str:
        return _sha256(_canonical_json(self.to_dict()))


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: shapes and one `HeadSpec` per query head.

    Query heads `g*G .. g*G+G-1` share KV head `g`, with G = num_heads // num_kv_heads.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    heads: tuple[HeadSpec, ...]
    logit_softcap: float = 0.0  # c > 0: each scaled score s becomes c * tanh(s / c); 0: off
    learned_sinks: bool = False  # the kernels take sinks= [H] float32, one logit per head
    scale: float | None = None  # the layer's default softmax scale (None: 1 / sqrt(head_dim))

    def __post_init__(self) -> None:
        _check_int("LayerSpec", "num_heads", self.num_heads, 1)
        if self.num_heads > MAX_HEADS:
            raise SpecError(f"LayerSpec.num_heads must be <= {MAX_HEADS}, got {self.num_heads!r}")
        _check_int("LayerSpec", "num_kv_heads", self.num_kv_heads, 1)
        _check_int("LayerSpec", "head_dim", self.head_dim, 1)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"LayerSpec.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise SpecError(
                f"LayerSpec.head_dim must be a multiple of 16 from {SUPPORTED_HEAD_DIMS[0]} to "
                f"{SUPPORTED_HEAD_DIMS[-1]}, got {self.head_dim!r}"
            )
        softcap = _real(self.logit_softcap)
        if softcap is None or not (softcap == 0 or MIN_SOFTCAP <= softcap <= MAX_SOFTCAP):
            raise SpecError(
                f"LayerSpec.logit_softcap must be 0 (off) or a number in [{MIN_SOFTCAP:g}, {MAX_SOFTCAP:g}], "
                f"got {self.logit_softcap!r:.80}"
            )
        object.__setattr__(self, "logit_softcap", softcap)
        if not isinstance(self.learned_sinks, bool):
            raise SpecError(f"LayerSpec.learned_sinks must be a bool, got {self.learned_sinks!r:.80}")
        if self.scale is not None:
            scale = _real(self.scale)
            if scale is None or not (MIN_SCALE <= scale <= MAX_SCALE):
                raise SpecError(
                    f"LayerSpec.scale must be None or a finite number in [{MIN_SCALE:.3g}, {MAX_SCALE:.3g}], "
                    f"got {self.scale!r:.80}"
                )
            object.__setattr__(self, "scale", scale)
        if not isinstance(self.heads, (tuple, list)):
            raise SpecError(f"LayerSpec.heads must be a sequence of HeadSpec, got {self.heads!r}")
        heads = tuple(self.heads)
        for i, head in enumerate(heads):
            if not isinstance(head, HeadSpec):
                raise SpecError(f"LayerSpec.heads[{i}] must be a HeadSpec, got {head!r}")
        if len(heads) != self.num_heads:
            raise SpecError(f"LayerSpec.heads has {len(heads)} entries, but num_heads is {self.num_heads}")
        object.__setattr__(self, "heads", heads)
        # The canonical JSON, made once: kernel keys and the registered ops take it, and under
        # torch.compile reading a str attribute is a constant, where calling to_json() on the
        # frozen instance is something torch 2.11's dynamo cannot trace. Not a field: eq, hash
        # and repr see only the fields.
        object.__setattr__(self, "_json", _canonical_json(self.to_dict()))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self, head: int) -> int:
        return head // self.group_size

    @property
    def is_dense(self) -> bool:
        """Every head sees every causal key (soft-cap and learned sinks change the scores, not
        which keys are seen)."""
        return all(h.dense for h in self.heads)

    @property
    def default_scale(self) -> float:
        """The softmax scale a call with `scale=None` uses."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def features(self) -> tuple[str, ...]:
        """The optional attention features this layer uses, by name, in a fixed order; a kernel
        that does not implement one of them must refuse the layer."""
        found = []
        if any(h.sink_tokens for h in self.heads):
            found.append("sink_tokens")
        if self.logit_softcap:
            found.append("logit_softcap")
        if self.learned_sinks:
            found.append("learned_sinks")
        return tuple(found)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct head kinds, in first-seen order (more than one: a hybrid layer)."""
        return tuple(dict.fromkeys(h.kind for h in self.heads))

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "heads": [h.to_dict() for h in self.heads],
            # the optional fields only when set: a spec that does not use them keeps its digest
            **({"logit_softcap": self.logit_softcap} if self.logit_softcap else {}),
            **({"learned_sinks": True} if self.learned_sinks else {}),
            **({"scale": self.scale} if self.scale is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerSpec:
        data = _known_keys(cls, data, "layer")
        heads = data.get("heads")
        if not isinstance(heads, list):
            raise SpecError(f"layer field 'heads' must be a list, got {heads!r}")
        for i, head in enumerate(heads):
            if not isinstance(head, dict):
                raise SpecError(f"layer field 'heads[{i}]' must be an object, got {head!r}")
        return cls(**{**data, "heads": tuple(HeadSpec.from_dict(h) for h in heads)})

    def to_json(self) -> str:
        return self._json

    @classmethod
    def from_json(cls, text: str) -> LayerSpec:
        return cls.from_dict(_load_json(text))

    def digest(self) -> str:
        return _sha256(self.to_json())


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: a name and one `LayerSpec` per layer."""

    name: str
    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"ModelSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.layers, (tuple, list)) or not self.layers:
            raise SpecError(f"ModelSpec.layers must be a non-empty sequence, got {self.layers!r}")
        layers = tuple(self.layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerSpec):
                raise SpecError(f"ModelSpec.layers[{i}] must be a LayerSpec, got {layer!r}")
        object.__setattr__(self, "layers", layers)

    def distinct_layers(self) -> list[tuple[LayerSpec, list[int]]]:
        """Each distinct layer spec with the layer indices that use it, in first-seen order."""
        seen: dict[LayerSpec, list[int]] = {}
        for i, layer in enumerate(self.layers):
            seen.setdefault(layer, []).append(i)
        return list(seen.items())

    def first_sparse_layer(self) -> int:
        """Index of the first layer that is not fully dense (0 if all are dense)."""
        return next((i for i, layer in enumerate(self.layers) if not layer.is_dense), 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SPEC_FORMAT,
            "name": self.name,
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        if not isinstance(data, dict):
            raise SpecError(f"a model spec must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format")
        if fmt != SPEC_FORMAT:
            raise SpecError(f"spec field 'format' must be {SPEC_FORMAT!r}, got {fmt!r}")
        data = _known_keys(cls, {k: v for k, v in data.items() if k != "format"}, "model")
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise SpecError(f"model field 'layers' must be a list, got {layers!r}")
        for i, layer in enumerate(layers):
            if not isinstance(layer, dict):
                raise SpecError(f"model field 'layers[{i}]' must be an object, got {layer!r}")
        return cls(name=data.get("name"), layers=tuple(LayerSpec.from_dict(x) for x in layers))

    def to_json(self) -> str:
        return _canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        return cls.from_dict(_load_json(text))

    def digest(self) -> str:
        return _sha256(self.to_json())


def _load_json(text: str) -> Any:
    return jsonio.loads(text, "spec", SpecError)


def _known_keys(cls: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise SpecError(f"a {what} must be a JSON object (dict), got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"unknown {what} field(s) {unknown}; expected some of {sorted(names)}")
    required = {f.name for f in fields(cls) if f.default is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise SpecError(f"{what} is missing field(s) {missing}")
    return dict(data)
