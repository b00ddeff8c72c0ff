"""`sparsegen serve`: an OpenAI-compatible HTTP server over Phi-3-Small (needs the [serve] extra).

    sparsegen serve --random tiny --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "random-tiny", "prompt": "Hello", "max_tokens": 8}'

vLLM's spellings work too (`vllm_options.py`): `sparsegen serve DIR --dtype bfloat16
--tensor-parallel-size 2 --enforce-eager --api-key KEY`.

`--port 0` takes a free port; the log line "serving ... on http://HOST:PORT" names it. `--tp N`
runs the model over N tensor-parallel processes (one GPU each; gloo ranks with --device cpu).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ..errors import MissingExtraError, SparsegenError
from .exits import RuntimeFailure, first_line, is_usage_error
from .options import (
    RANDOM_CHOICES,
    engine_step_kwargs,
    engine_step_options,
    kv_cache_dtype_option,
    torch_device,
)
from .tp_option import check_tp, tensor_parallel_option
from .vllm_options import (
    DTYPES,
    chat_template_text,
    check_api_key,
    dtype_of,
    pick_model,
    pick_tp,
    vllm_options,
)


def _log_to_stderr() -> None:
    logger = logging.getLogger("sparsegen")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


@click.command("serve")
@click.argument(
    "model_arg", metavar="[MODEL]", required=False,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
)  # fmt: skip
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="HF checkpoint folder.",
)
@click.option(
    "--random",
    "random_size",
    type=click.Choice(RANDOM_CHOICES),
    help="Random weights of a named size (Phi-3-Small's or a family preset).",
)
@click.option(
    "--tokenizer", "tokenizer_path", type=click.Path(exists=True), help="A .tiktoken file (or folder)."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port."
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=256,
    show_default=True,
    help="Sequences that may wait beyond the running batch; more get HTTP 503.",
)
@click.option(
    "--served-model-name", default=None, help="The model id clients send (default: the path or random-NAME)."
)
@click.option("--device", default=None, help="cuda or cpu (default: cuda when available).")
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="auto (the default): bf16 on GPU, fp32 on CPU.",
)
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True, help="Sequences at once."
)
@click.option(
    "--max-model-len", type=click.IntRange(min=2), default=None, help="Context limit (default: the model's)."
)
@engine_step_options
@kv_cache_dtype_option
@click.option(
    "--compile-model", is_flag=True, help="Decode steps through torch.compile inside the CUDA graphs."
)
@click.option("--no-warmup", is_flag=True, help="Skip the warm-up request before listening.")
@click.option(
    "--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
    help="On SIGTERM, seconds running requests may take to finish.",
)  # fmt: skip
@tensor_parallel_option
@vllm_options
def command(
    model_arg, model_dir, random_size, tokenizer_path, host, port, max_queue, served_model_name, device, dtype, max_num_seqs,
    max_model_len, chunk_size, page_size, no_cuda_graphs, kv_cache_dtype, compile_model, no_warmup, drain_timeout, tp,
    enable_prefix_caching, tp_alias, enforce_eager, gpu_memory_utilization, seed, chat_template, api_key, strict,
):  # fmt: skip
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
    /detokenize, /health, /metrics)."""
    model_dir = pick_model(model_arg, model_dir)
    if (model_dir is None) == (random_size is None):
        raise click.UsageError(
            "give exactly one of --model DIR or --random NAME (the folder may be given as MODEL)"
        )
    tp, dtype = pick_tp(tp, tp_alias), dtype_of(dtype)
    api_key, template = check_api_key(api_key), chat_template_text(chat_template)
    try:
        from ..serve.server import serve
    except ImportError as exc:
        raise MissingExtraError(  # a runtime failure: exit 1, one line (cli.py)
            f"sparsegen serve needs the [serve] extra (pip install 'sparsegen[serve]'): {exc}"
        ) from None
    device = torch_device(device)
    check_tp(tp, model_dir, random_size, device)
    _log_to_stderr()
    from ..llm import LLM

    try:
        steps = engine_step_kwargs(
            chunk_size, page_size, no_cuda_graphs or enforce_eager, enable_prefix_caching
        )
        llm = LLM(model=model_dir, random=random_size, tokenizer=tokenizer_path, dtype=dtype, device=device,
                  seed=seed, tensor_parallel_size=tp, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  compile_model=compile_model, kv_cache_dtype=kv_cache_dtype,
                  gpu_memory_utilization=gpu_memory_utilization, **steps)  # fmt: skip
        if template is not None:
            llm.use_chat_template(*template)
        if not no_warmup:
            seconds = llm.engine.warmup()
            logging.getLogger("sparsegen").info(
                "warm-up (kernel builds, first CUDA-graph capture): %.2f s", seconds
            )
    except SparsegenError as exc:  # bad input: exit 2; a runtime failure (e.g. MemoryLimitError): exit 1
        if is_usage_error(exc):
            raise click.UsageError(first_line(exc)) from None
        raise RuntimeFailure(first_line(exc)) from None
    try:
        serve(llm, host, port, max_queue=max_queue, drain_timeout=drain_timeout, model_name=served_model_name,
              api_key=api_key, strict=strict)  # fmt: skip
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from None
    finally:
        llm.close()  # the ranks exit (with --tp); on a crash, the executor's finalizer stops them
