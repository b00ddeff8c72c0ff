"""Option parsers shared by several commands."""

from __future__ import annotations

import math

import click

from ..errors import SpecError
from ..presets import get_pattern
from ..spec import ModelSpec

# `--random` names: models.families.RANDOM_NAMES, spelled out so that the CLI imports no torch
# to list them (tests/cli checks that the two agree)
RANDOM_CHOICES = ("tiny", "7b", "mistral-7b", "llama3-8b", "qwen2-7b", "gemma2-9b", "gpt-oss-20b")


def load_pattern(name_or_path: str) -> ModelSpec:
    try:
        return get_pattern(name_or_path)
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="'--pattern'") from None
    except RecursionError:  # json's decoder on absurdly nested input
        raise click.BadParameter(
            f"{name_or_path} is nested too deeply to be a spec", param_hint="'--pattern'"
        ) from None


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


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A click callback: NaN and infinities are usage errors (FloatRange lets NaN through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value!r} is not a finite number")
    return value


SEED = click.IntRange(0, 2**63 - 1)  # what torch.Generator and hypothesis both take


def check_arch(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: None (pick one) or an arch env.parse_arch accepts, e.g. sm_90."""
    if value is None:
        return None
    from ..env import parse_arch
    from ..errors import ArchError

    try:
        parse_arch(value)
    except ArchError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def torch_device(value: str | None) -> str:
    """'cpu', 'cuda' or 'cuda:N' (an existing GPU); None picks cuda when torch sees one."""
    import torch

    if value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(value.strip()) if value.strip() else None
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise click.BadParameter(f"{value!r} is not 'cpu', 'cuda' or 'cuda:N'", param_hint="'--device'")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise click.BadParameter(
                f"{value!r} was asked for, but torch sees no CUDA GPU", param_hint="'--device'"
            )
        if device.index is not None and device.index >= count:
            raise click.BadParameter(
                f"{value!r}: torch sees {count} CUDA GPU(s), 0..{count - 1}", param_hint="'--device'"
            )
    return str(device)


def engine_step_options(command):
    """--chunk-size, --page-size, --no-cuda-graphs and --[no-]enable-prefix-caching: how the engine
    steps, for generate and serve.
    The defaults are EngineConfig's, written out so that `--help` needs no torch import
    (tests/cli/test_cli_conventions.py holds them equal)."""
    command = click.option("--no-cuda-graphs", is_flag=True, help="Run decode steps eagerly on GPU.")(command)
    command = click.option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        default=True,
        show_default=True,
        help="Keep full KV pages for later requests with the same prefix.",
    )(command)
    command = click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)(command)
    return click.option(
        "--chunk-size",
        type=click.IntRange(min=1),
        default=32768,
        show_default=True,
        help="Prefill tokens per step.",
    )(command)


KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # runner.config.KV_CACHE_DTYPES


def kv_cache_dtype_option(command):
    """`--kv-cache-dtype`: the KV cache's element type (EngineConfig.kv_cache_dtype)."""
    return click.option(
        "--kv-cache-dtype",
        type=click.Choice(KV_CACHE_DTYPE_CHOICES),
        default="auto",
        show_default=True,
        help="KV cache element type: auto (the model's dtype) or fp8 (e4m3; fp8_e5m2 too), one byte "
        "an element with per-KV-head scales from the checkpoint or the first prefill.",
    )(command)


def engine_step_kwargs(
    chunk_size: int, page_size: int, no_cuda_graphs: bool, enable_prefix_caching: bool = True
) -> dict:
    """`engine_step_options`' values as the LLMEngine keywords they stand for."""
    return {
        "max_num_batched_tokens": chunk_size,
        "page_size": page_size,
        "use_cuda_graphs": not no_cuda_graphs,
        "enable_prefix_caching": enable_prefix_caching,
    }
