"""`sparsegen generate`: run Phi-3-Small (a local checkpoint or random weights) and print text.

Prompts are taken in this order: every `--prompt`, then every `--prompt-ids`, then the lines
of `--prompts-file`. With `--json`, one JSON object per prompt is printed, in that order. The
command is `sparsegen.LLM` with a progress bar: one engine, the one output path, and the
finish reasons of DESIGN §3 (`cli_finish_reason`: "eos" for the engine's EOS token).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .. import dtypes
from ..log import get_logger
from . import progress
from .options import (
    RANDOM_CHOICES,
    SEED,
    engine_step_kwargs,
    engine_step_options,
    finite,
    kv_cache_dtype_option,
    torch_device,
)
from .tp_option import check_tp, tensor_parallel_option

log = get_logger(__name__)

DTYPES = {d.name: d.torch_name for d in dtypes.TABLE}  # bf16 -> bfloat16, ...


def parse_prompt_ids(text: str, vocab_size: int, hint: str = "'--prompt-ids'") -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of token ids", param_hint=hint
        ) from None
    if not ids:
        raise click.BadParameter("an empty list of token ids", param_hint=hint)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise click.BadParameter(
            f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}", param_hint=hint
        )
    return ids


def _collect_prompts(prompt, prompt_ids, prompts_file, tokenizer, vocab_size, wrap=None) -> list[list[int]]:
    texts = list(prompt)
    file_texts = []
    if prompts_file is not None:
        try:
            file_texts = [t for t in Path(prompts_file).read_text().splitlines() if t.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(
                f"cannot read {prompts_file}: {exc}", param_hint="'--prompts-file'"
            ) from None
    if (texts or file_texts) and tokenizer is None:
        raise click.UsageError(
            "this checkpoint has no .tiktoken file: pass --prompt-ids, or --tokenizer FILE"
        )
    if wrap is not None:  # --chat: each text becomes a user turn of the chat template
        texts, file_texts = [wrap(t) for t in texts], [wrap(t) for t in file_texts]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts += [parse_prompt_ids(p, vocab_size) for p in prompt_ids]
    prompts += [tokenizer.encode(t) for t in file_texts]
    if not prompts:
        raise click.UsageError("give at least one --prompt, --prompt-ids or --prompts-file")
    for i, p in enumerate(prompts):
        if not p:
            raise click.UsageError(f"prompt {i} encodes to no tokens")
    return prompts


@click.command("generate")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local HF checkpoint folder.",
)
@click.option(
    "--random",
    "random_size",
    type=click.Choice(RANDOM_CHOICES),
    help="Random weights of a named size (Phi-3-Small's or a family preset).",
)
@click.option("--prompt", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompt-ids", multiple=True, help="Prompt as comma-separated token ids (repeatable).")
@click.option("--prompts-file", type=click.Path(dir_okay=False, exists=True), help="One prompt per line.")
@click.option(
    "--tokenizer", "tokenizer_path", type=click.Path(exists=True), help="A .tiktoken file (or folder)."
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    callback=finite,
    default=0.0,
    show_default=True,
    help="0 is greedy.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    callback=finite,
    default=1.0,
    show_default=True,
)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 is off.")
@click.option("--seed", type=SEED, default=None)
@click.option("--ignore-eos", is_flag=True, help="Keep going past EOS (for benchmarks).")
@click.option("--device", default=None, help="cuda or cpu (default: cuda when available).")
@click.option(
    "--dtype", type=click.Choice(list(DTYPES)), default=None, help="Default: bf16 on GPU, fp32 on CPU."
)
@click.option(
    "--stream/--no-stream",
    default=True,
    show_default=True,
    help="Print text as it is generated (single prompt, no --json).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt, in input order.")
@click.option("--force-dense", is_flag=True, help="Run every layer with a dense spec (for comparison).")
@click.option(
    "--max-batch", type=click.IntRange(min=1), default=32, show_default=True, help="Sequences at once."
)
@engine_step_options
@kv_cache_dtype_option
@click.option(
    "--no-warmup", is_flag=True, help="Skip the warm-up request (timings then include kernel builds)."
)
@click.option("--chat", is_flag=True, help="Send each text prompt as a user turn of the chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends before it.")
@click.option("--stop-token-ids", default=None, help="Comma-separated token ids that end generation.")
@tensor_parallel_option
def command(
    model_dir, random_size, prompt, prompt_ids, prompts_file, tokenizer_path, max_tokens, temperature, top_p,
    top_k, seed, ignore_eos, device, dtype, stream, as_json, force_dense, max_batch, chunk_size, page_size,
    no_cuda_graphs, kv_cache_dtype, no_warmup, chat, stop, stop_token_ids, tp, enable_prefix_caching,
):  # fmt: skip
    """Generate text with Phi-3-Small through sparsegen's block-sparse attention."""
    if (model_dir is None) == (random_size is None):
        raise click.UsageError("give exactly one of --model DIR or --random NAME")
    _generate(**locals())  # sparsegen's errors become one line in cli.py (exit 2 or 1)


def cli_finish_reason(out, eos_token_id: int, ignore_eos: bool) -> str:
    """The JSON line's finish reason: the output's "stop" | "length", except "eos" when the
    engine's own EOS token ended it (generation_config's other turn-ending tokens are "stop")."""
    eos = out.finish_reason == "stop" and out.stop_reason is None and not ignore_eos
    return "eos" if eos and out.token_ids[-1] == eos_token_id else out.finish_reason


def _generate(
    model_dir, random_size, prompt, prompt_ids, prompts_file, tokenizer_path, max_tokens, temperature, top_p,
    top_k, seed, ignore_eos, device, dtype, stream, as_json, force_dense, max_batch, chunk_size, page_size,
    no_cuda_graphs, kv_cache_dtype, no_warmup, chat, stop, stop_token_ids, tp, enable_prefix_caching,
):  # fmt: skip
    import torch

    from ..llm import LLM

    device = torch_device(device)
    dtype = getattr(torch, DTYPES[dtype or ("bf16" if device.startswith("cuda") else "fp32")])
    check_tp(tp, model_dir, random_size, device)
    if model_dir is not None and not model_dir.is_dir():
        raise click.BadParameter(f"checkpoint folder {model_dir} does not exist", param_hint="'--model'")
    llm = LLM(model=model_dir, random=random_size, tokenizer=tokenizer_path, dtype=dtype, device=device,
              force_dense=force_dense, tensor_parallel_size=tp, max_num_seqs=max_batch, kv_cache_dtype=kv_cache_dtype,
              **engine_step_kwargs(chunk_size, page_size, no_cuda_graphs, enable_prefix_caching))  # fmt: skip
    try:
        _run(llm, prompt, prompt_ids, prompts_file, max_tokens, temperature, top_p, top_k, seed, ignore_eos,
             stream, as_json, no_warmup, chat, stop, stop_token_ids, random_size is not None)  # fmt: skip
    finally:
        llm.close()  # the ranks exit (with --tp); on an error, the executor's finalizer stops them


def _run(llm, prompt, prompt_ids, prompts_file, max_tokens, temperature, top_p, top_k, seed, ignore_eos,
         stream, as_json, no_warmup, chat, stop, stop_token_ids, random_weights):  # fmt: skip
    from ..engine import SamplingParams

    tokenizer = llm.tokenizer
    vocab = tokenizer.vocab_size if tokenizer is not None else llm.vocab_size
    if chat and prompt_ids:
        raise click.UsageError("--chat takes text prompts (--prompt, --prompts-file), not --prompt-ids")
    turn = (lambda text: llm.chat_template.render([{"role": "user", "content": text}])) if chat else None
    prompts = _collect_prompts(prompt, prompt_ids, prompts_file, tokenizer, min(vocab, llm.vocab_size), turn)
    stop_ids = parse_prompt_ids(stop_token_ids, vocab, "'--stop-token-ids'") if stop_token_ids else []
    if random_weights and not chat:  # <|end|> ends a chat turn only; a checkpoint's generation_config always
        llm.eos_token_ids = llm.eos_token_ids[:1]
    if stop and tokenizer is None:
        raise click.UsageError("--stop needs a tokenizer (this checkpoint has no .tiktoken file)")
    params = SamplingParams(
        stop=tuple(stop),
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        ignore_eos=ignore_eos,
        skip_special_tokens=False,  # the text holds every token's text but the one that ended it
    )
    if not no_warmup:
        seconds = llm.engine.warmup()
        log.info(f"warm-up (kernel builds, first CUDA-graph capture): {seconds:.2f} s")
    live = stream and not as_json and len(prompts) == 1 and tokenizer is not None

    # Many prompts: a bar over the finished ones with the token rate (drawn on a terminal only).
    bar = progress.bar(len(prompts), "generate", unit="prompt", as_json=as_json or live)
    tokens = [0]

    def on_update(request, update):
        tokens[0] += 1
        if update.finish_reason is not None and request.finished:
            bar.update(1, postfix=f"{tokens[0] / max(time.perf_counter() - start, 1e-9):.1f} tok/s")
        if live and update.text:  # the text each token adds, held back near a possible stop string
            click.echo(update.text, nl=False)
            sys.stdout.flush()

    start = time.perf_counter()
    with bar:
        results = llm.generate(prompts, params, use_tqdm=False, on_update=on_update)
    wall = time.perf_counter() - start
    outs = [r.outputs[0] for r in results]
    if as_json:
        eos = llm.engine.eos_token_id
        for res, out in zip(results, outs, strict=True):
            line = {
                "prompt_ids": res.prompt_token_ids,
                "output_ids": out.token_ids,
                "text": out.text,
                "finish_reason": cli_finish_reason(out, eos, ignore_eos),
                "ttft_s": out.metrics.ttft_s,
                "decode_tokens_per_s": out.metrics.decode_tokens_per_s,
            }
            click.echo(json.dumps(line))
        return
    if live:
        click.echo()
    else:
        for i, out in enumerate(outs):
            shown = out.text if out.text is not None else ",".join(map(str, out.token_ids))
            click.echo(f"[{i}] {shown}")
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = sum(o.metrics.ttft_s for o in outs) / len(outs)
    decode = [o.metrics.decode_tokens_per_s for o in outs if o.metrics.decode_tokens_per_s > 0]
    per_seq = sum(decode) / len(decode) if decode else 0.0
    log.info(
        f"{len(outs)} prompt(s), {n_out} tokens in {wall:.2f} s: {n_out / wall:.1f} tokens/s overall, "
        f"{per_seq:.1f} tokens/s per sequence while decoding, time to first token {ttft:.3f} s (mean)"
    )
