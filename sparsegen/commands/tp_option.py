"""`--tp N` for generate and serve: the option, and its check against the model before anything starts."""

from __future__ import annotations

import click


def tensor_parallel_option(command):
    """--tp: the tensor-parallel size (1: this process runs the model)."""
    about = "Tensor-parallel size: this many processes (one GPU each), each holding whole KV groups."
    return click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help=about)(command)


def check_tp(tp: int, model_dir, random_size: str | None, device: str) -> None:
    """--tp against the model's config (config.json, or the named random size) and the visible
    GPUs, before any weight is read or any rank started; a bad one is a usage error naming --tp."""
    if tp == 1:
        return
    from ..engine.executor import model_facts
    from ..errors import InputError
    from ..parallel.source import ModelSource
    from ..runner.config import EngineConfig

    source = ModelSource(model_dir=str(model_dir) if model_dir is not None else None, random=random_size)
    try:
        model_facts(source, EngineConfig(tensor_parallel_size=tp), device)
    except InputError as exc:
        raise click.BadParameter(str(exc), param_hint="'--tp'") from None
