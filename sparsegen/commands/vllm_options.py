"""vLLM's spellings of `sparsegen serve`'s options, and what they turn into.

sparsegen serve [MODEL]          the folder positionally (the same as --model)
--dtype auto|bfloat16|float16|float32|half|float   (besides bf16, fp16, fp32; auto: the default)
--tensor-parallel-size N         the same as --tp
--enforce-eager                  no CUDA graphs (the same as --no-cuda-graphs)
--gpu-memory-utilization F       the share (0, 1] of the GPU's memory the engine may take for the
                                 weights, the KV cache and a step's activations (vLLM's meaning;
                                 default: 90 % of the free memory less a headroom; not used on a CPU)
--seed N                         the seed of random weights and of unseeded sampling
--chat-template FILE|TEXT        a Jinja chat template, rendered in the same sandbox
--api-key KEY / SPARSEGEN_API_KEY
"""

from __future__ import annotations

from pathlib import Path

import click

from .options import SEED

DTYPES = ("auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "half", "float32", "float")
MAX_TEMPLATE_ARG = 1 << 16  # characters of an inline --chat-template
MAX_TEMPLATE_FILE = 1 << 20  # bytes of a --chat-template file


def vllm_options(command):
    """The options above (the positional MODEL is the command's own argument)."""
    for opt in reversed(
        (
            click.option("--tensor-parallel-size", "tp_alias", type=click.IntRange(min=1), default=None,
                         help="vLLM's name for --tp."),
            click.option("--enforce-eager", is_flag=True, help="No CUDA graphs (vLLM's name for --no-cuda-graphs)."),
            click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
                         help="Share of the GPU's memory for weights, KV cache and activations (vLLM's meaning)."),
            click.option("--seed", type=SEED, default=0, show_default=True,
                         help="Seed of random weights and of requests without their own seed."),
            click.option("--chat-template", default=None,
                         help="A chat template: a file's path, or the Jinja text itself."),
            click.option("--api-key", default=None, envvar="SPARSEGEN_API_KEY", show_envvar=True,
                         help="Ask for 'Authorization: Bearer KEY' on every route but /health and /metrics."),
            click.option("--strict", is_flag=True,
                         help="Refuse unknown request fields with a 400 (default: drop and log them once)."),
        )
    ):  # fmt: skip
        command = opt(command)
    return command


def pick_model(positional: Path | None, option: Path | None) -> Path | None:
    """The folder given positionally or with --model; both and different is a usage error."""
    if positional is not None and option is not None and positional.resolve() != option.resolve():
        raise click.UsageError(
            f"the folder is given twice and differently: {positional} and --model {option}"
        )
    return positional if positional is not None else option


def pick_tp(tp: int, alias: int | None) -> int:
    if alias is not None and tp != 1 and alias != tp:
        raise click.UsageError(f"--tp {tp} and --tensor-parallel-size {alias} disagree")
    return alias if alias is not None else tp


def dtype_of(value: str | None) -> str | None:
    return None if value in (None, "auto") else value


def check_api_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not value or value != value.strip() or not value.isprintable():
        raise click.BadParameter("the key must be non-empty printable text without surrounding spaces",
                                 param_hint="'--api-key' / SPARSEGEN_API_KEY")  # fmt: skip
    return value


def chat_template_text(value: str | None) -> tuple[str, str] | None:
    """(template, origin) of --chat-template: a file's text when it names a file, else the text."""
    if value is None:
        return None
    if "{" not in value and len(value) < 4096:
        path = Path(value).expanduser()
        if not path.is_file():
            raise click.BadParameter(f"{value} is not a file, nor a template ({{ }} inside)",
                                     param_hint="'--chat-template'")  # fmt: skip
        try:
            if path.stat().st_size > MAX_TEMPLATE_FILE:
                raise click.BadParameter(
                    f"{path} is over {MAX_TEMPLATE_FILE} bytes", param_hint="'--chat-template'"
                )
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="'--chat-template'") from None
    if len(value) > MAX_TEMPLATE_ARG:
        raise click.BadParameter(f"an inline template is at most {MAX_TEMPLATE_ARG} characters",
                                 param_hint="'--chat-template'")  # fmt: skip
    return value, "--chat-template"
