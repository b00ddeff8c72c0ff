"""Option parsers shared by several commands."""

from __future__ import annotations

import click

from ..errors import SpecError
from ..presets import get_pattern
from ..spec import ModelSpec


def load_pattern(name_or_path: str) -> ModelSpec:
    try:
        return get_pattern(name_or_path)
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="'--pattern'") from None


def pick_layer(model: ModelSpec, layer: int | None) -> int:
    """The requested layer index, or the first sparse one; a clear error when out of range."""
    if layer is None:
        return model.first_sparse_layer()
    if not 0 <= layer < len(model.layers):
        raise click.BadParameter(
            f"layer {layer} is out of range: {model.name} has {len(model.layers)} layers",
            param_hint="'--layer'",
        )
    return layer
