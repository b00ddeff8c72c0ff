"""Exact-typed reads of HF `config.json` fields: an int is an int (not a bool or a float), a
float is finite, and every message names the file and the field."""

from __future__ import annotations

import math
from typing import Any

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
