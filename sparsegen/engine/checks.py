"""Checks of what a caller submits (prompts and sampling parameters), run before anything is queued.

The engine checks every prompt and every `SamplingParams` of a call first, and only then adds
any of them, so a bad prompt at index 2 leaves nothing queued from indices 0 and 1.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from ..errors import InputError
from ..request.sampling_params import SamplingParams


def check_prompt(prompt: object, vocab_size: int, where: str = "prompt") -> list[int]:
    """A list (or tuple) of exact ints in 0..vocab_size-1; returns a fresh list."""
    if isinstance(prompt, str):
        raise InputError(
            f"{where} is a str; the engine takes token ids (encode the text first, or use sparsegen.LLM)"
        )
    if not isinstance(prompt, (list, tuple)):
        raise InputError(f"{where} must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise InputError(f"{where} needs at least one token")
    if _plain_ids_in_range(prompt, vocab_size):
        return list(prompt)
    for pos, tok in enumerate(prompt):  # something is wrong: find the first bad token, in order
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise InputError(f"{where} token {pos} is {tok!r} ({type(tok).__name__}), not an int token id")
        if not 0 <= tok < vocab_size:
            raise InputError(f"{where} token {tok!r} is not an id of the vocabulary 0..{vocab_size - 1}")
    return list(prompt)


def _plain_ids_in_range(prompt: list | tuple, vocab_size: int) -> bool:
    """True if every token is a plain int in 0..vocab_size-1, checked without a Python-level loop
    per token (the type set, then the range over an int64 copy); False means "look closer" (an
    int subclass such as an IntEnum is fine but takes the loop)."""
    if set(map(type, prompt)) != {int}:
        return False
    try:
        ids = np.array(prompt, dtype=np.int64)
    except OverflowError:  # beyond int64: out of range anyway
        return False
    return int(ids.min()) >= 0 and int(ids.max()) < vocab_size


def check_params(params: object, vocab_size: int, where: str = "params") -> SamplingParams:
    """Every field checked again at the boundary (a SamplingParams may be built with
    object.__setattr__ or come from a subclass), then what depends on the model: stop token ids
    and the number of log-probabilities within its vocabulary."""
    if not isinstance(params, SamplingParams):
        raise InputError(f"{where} must be a SamplingParams, got {type(params).__name__}")
    SamplingParams.validate(params)  # the class's own checks, whatever a subclass overrides
    for tok in params.stop_token_ids:
        if not tok < vocab_size:
            raise InputError(
                f"SamplingParams.stop_token_ids holds {tok!r}, not a token id in 0..{vocab_size - 1}"
            )
    check_processor_ids(params, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab_size:
            raise InputError(f"SamplingParams.{name} is {k}, more than the vocabulary's {vocab_size} tokens")
    return params


def check_processor_ids(params: SamplingParams, vocab_size: int, where: str = "SamplingParams") -> None:
    """`logit_bias` and `allowed_token_ids` name token ids of the vocabulary 0..vocab_size-1."""
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:  # pairs are sorted by id
        raise InputError(
            f"{where}.logit_bias holds token {params.logit_bias[-1][0]}, not a token id in 0..{vocab_size - 1}"
        )
    if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab_size:
        raise InputError(
            f"{where}.allowed_token_ids holds {max(params.allowed_token_ids)}, not a token id in "
            f"0..{vocab_size - 1}"
        )


def expand_params(params: object, n: int) -> list[object]:
    """One SamplingParams for all prompts, or a list of exactly one per prompt."""
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (str, bytes)) or not isinstance(params, Seq):
        raise InputError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
    if len(params) != n:
        raise InputError(f"got {n} prompts but {len(params)} SamplingParams")
    return list(params)
