"""How one request becomes engine sequences: the tokens that end a turn, and the `n`
single-sequence `SamplingParams` of a request's completions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..request.sampling_params import SEED_LIMIT, SamplingParams
from .chat import eos_token_ids


def turn_end_ids(folder: Path | None, tokenizer, eos_token_id: int, vocab_size: int) -> tuple[int, ...]:
    """The engine's EOS first, then `generation_config.json`'s eos_token_id list; for random
    weights (no folder), `<|end|>` too, as Phi-3-Small-instruct's generation_config has it."""
    eos = eos_token_ids(folder, vocab_size)
    if eos is None:
        eos = ()
        end = tokenizer.special_tokens.get("<|end|>") if tokenizer is not None and folder is None else None
        if end is not None:
            eos = (end,)
    return tuple(dict.fromkeys((eos_token_id, *eos)))


def child_params(params: SamplingParams, extra_stop_ids: tuple[int, ...]) -> list[SamplingParams]:
    """The n single-sequence SamplingParams of one request: seeds `seed + i`, and the turn-ending
    tokens added to `stop_token_ids` (unless `ignore_eos`)."""
    stops = params.stop_token_ids
    if not params.ignore_eos:
        stops = stops + tuple(t for t in extra_stop_ids if t not in stops)
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i) % SEED_LIMIT
        out.append(dataclasses.replace(params, n=1, seed=seed, stop_token_ids=stops))
    return out
