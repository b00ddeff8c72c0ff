"""`sparsegen generate`: run Phi-3-Small (a local checkpoint or random weights) and print text.

Prompts are taken in this order: every `--prompt`, then every `--prompt-ids`, then the lines
of `--prompts-file`. With `--json`, one JSON object per prompt is printed, in that order.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .. import dtypes, progress
from ..log import get_logger
from .options import SEED, engine_step_kwargs, engine_step_options, finite, torch_device
from .tp_option import check_tp, tensor_parallel_option

log = get_logger(__name__)

DTYPES = {d.name: d.torch_name for d in dtypes.TABLE}  # bf16 -> bfloat16, ...


def _chat_wrapper(model_dir):
    from ..llm.chat import ChatTemplate

    template = ChatTemplate.from_folder(model_dir)
    return lambda text: template.render([{"role": "user", "content": text}])


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
    "--random", "random_size", type=click.Choice(["tiny", "7b"]), help="Random weights of a named size."
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
    no_cuda_graphs, no_warmup, chat, stop, stop_token_ids, tp,
):  # fmt: skip
    """Generate text with Phi-3-Small through sparsegen's block-sparse attention."""
    if (model_dir is None) == (random_size is None):
        raise click.UsageError("give exactly one of --model DIR or --random tiny|7b")
    _generate(**locals())  # sparsegen's errors become one line in cli.py (exit 2 or 1)


def _generate(
    model_dir, random_size, prompt, prompt_ids, prompts_file, tokenizer_path, max_tokens, temperature, top_p,
    top_k, seed, ignore_eos, device, dtype, stream, as_json, force_dense, max_batch, chunk_size, page_size,
    no_cuda_graphs, no_warmup, chat, stop, stop_token_ids, tp,
):  # fmt: skip
    import torch

    from ..engine import LLMEngine, SamplingParams
    from ..llm.api import build_model, turn_end_ids

    device = torch_device(device)
    dtype = getattr(torch, DTYPES[dtype or ("bf16" if device.startswith("cuda") else "fp32")])
    engine_kwargs = dict(max_num_seqs=max_batch, **engine_step_kwargs(chunk_size, page_size, no_cuda_graphs))
    check_tp(tp, model_dir, random_size, device)
    if tp > 1:  # ranks are separate processes; this one drives them
        from ..tp_engine import tp_engine_for

        engine = tp_engine_for(model_dir, random_size, tokenizer_path, device, dtype, force_dense, 0, tp,
                               {**engine_kwargs, "warmup": not no_warmup})  # fmt: skip
        tokenizer, config = engine.tokenizer, engine.model_config
    else:
        model, tokenizer = build_model(model_dir, random_size, tokenizer_path, device, dtype, force_dense)
        engine, config = LLMEngine(model, tokenizer=tokenizer, **engine_kwargs), model.config
    vocab = tokenizer.vocab_size if tokenizer is not None else config.vocab_size
    if chat and prompt_ids:
        raise click.UsageError("--chat takes text prompts (--prompt, --prompts-file), not --prompt-ids")
    turn = _chat_wrapper(model_dir) if chat else None
    prompts = _collect_prompts(
        prompt, prompt_ids, prompts_file, tokenizer, min(vocab, config.vocab_size), turn
    )
    stop_ids = parse_prompt_ids(stop_token_ids, vocab, "'--stop-token-ids'") if stop_token_ids else []
    if (chat or model_dir is not None) and not ignore_eos:  # generation_config's turn-end tokens
        stop_ids += turn_end_ids(
            model_dir, tokenizer, tokenizer.eos_token_id if tokenizer else config.eos_token_id, vocab
        )[1:]
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
    )
    if not no_warmup:
        seconds = engine.warmup()
        log.info(f"warm-up (kernel builds, first CUDA-graph capture): {seconds:.2f} s")
    live = stream and not as_json and len(prompts) == 1 and tokenizer is not None
    decode_piece = tokenizer.stream_decoder() if live else None
    eos = engine.eos_token_id
    watch = None
    if stop:
        from ..engine.outputs import StopStrings

        watch = StopStrings(
            engine, tokenizer, [params] * len(prompts), frozenset({eos, *params.stop_token_ids})
        )

    # Many prompts: a bar over the finished ones with the token rate (drawn on a terminal only).
    bar = progress.bar(len(prompts), "generate", unit="prompt", as_json=as_json or live)
    tokens = [0]

    def on_token(event):
        tokens[0] += 1
        if event.finish_reason is not None:
            bar.update(1, postfix=f"{tokens[0] / max(time.perf_counter() - start, 1e-9):.1f} tok/s")
        if watch is not None:  # stop strings: the text each token adds, held back near a stop string
            piece = watch(event)
            if live:
                click.echo(piece, nl=False)
                sys.stdout.flush()
        elif (
            live
            and event.finish_reason not in ("eos", "stop")
            and not (event.token_id == eos and not ignore_eos)
        ):
            click.echo(decode_piece(event.token_id), nl=False)
            sys.stdout.flush()

    start = time.perf_counter()
    with bar:
        results = engine.generate(prompts, params, on_token=on_token)
    if watch is not None:
        results = watch.apply(results)
    wall = time.perf_counter() - start
    if tp > 1:
        engine.close()  # on an error, the TPEngine's finalizer stops the ranks
    if as_json:
        for res in results:
            click.echo(json.dumps(res.to_json_dict()))
        return
    if live:
        click.echo()
    else:
        for i, res in enumerate(results):
            shown = res.text if res.text is not None else ",".join(map(str, res.output_ids))
            click.echo(f"[{i}] {shown}")
    n_out = sum(len(r.output_ids) for r in results)
    ttft = sum(r.ttft_s for r in results) / len(results)
    decode = [r.decode_tokens_per_s for r in results if r.decode_tokens_per_s > 0]
    per_seq = sum(decode) / len(decode) if decode else 0.0
    log.info(
        f"{len(results)} prompt(s), {n_out} tokens in {wall:.2f} s: {n_out / wall:.1f} tokens/s overall, "
        f"{per_seq:.1f} tokens/s per sequence while decoding, time to first token {ttft:.3f} s (mean)"
    )
