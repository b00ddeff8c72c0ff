"""Sampling parameters (vLLM's names and meanings) and the types a sampler returns.

`SamplingParams` checks every field when it is made, so a bad request is an InputError before
anything runs; the sampler that reads them is `runner.sampling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError

MAX_LOGPROBS = 20  # most top-k log-probabilities a request may ask for per step
SEED_LIMIT = 2**64  # seeds are 0..2**64-1, as torch.Generator.manual_seed takes them


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    ok = (
        isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    )
    if not ok:
        span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise InputError(f"SamplingParams.{name} must be an int {span}, got {value!r}")


def _check_float(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise InputError(f"SamplingParams.{name} must be a finite number in {span}, got {value!r}")


def _as_tuple(name: str, value, item_type: type) -> tuple:
    if value is None:
        return ()
    if item_type is str and isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise InputError(f"SamplingParams.{name} must be a list of {item_type.__name__}, got {value!r}")
    for item in value:
        if not isinstance(item, item_type) or isinstance(item, bool):
            raise InputError(f"SamplingParams.{name} items must be {item_type.__name__}, got {item!r}")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each new token and when to stop, with vLLM's field names and meanings.

    - `n`: completions per prompt (their seeds are `seed + i` when `seed` is given).
    - `max_tokens` / `min_tokens`: at most / at least this many new tokens (EOS and the stop
      tokens are masked until `min_tokens` is reached).
    - `temperature`: 0 is greedy. Unlike vLLM (1.0), the default here is greedy.
    - `top_p` (1 = off), `top_k` (0 or -1 = off), `min_p` (0 = off): filters applied after the
      temperature.
    - `repetition_penalty` (1 = off; > 1 discourages tokens seen in the prompt or output),
      `presence_penalty` and `frequency_penalty` (0 = off; in [-2, 2], on output tokens).
    - `stop`: strings matched on the decoded text, across token boundaries; the text ends before
      the stop string (`engine.output_processor` does the matching; it needs a tokenizer).
    - `stop_token_ids`: token ids that end generation (kept in `token_ids`, not in the text).
    - `ignore_eos`: keep going past EOS.
    - `logprobs`: `None`, or how many top log-probabilities to return per step (0 returns only
      the sampled token's); computed from the model's raw logits, before any penalty.
    - `seed`: a per-request random stream, reproducible whatever else is in the batch.
    - `skip_special_tokens`: leave special tokens (`<|user|>`, ...) out of the text.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise InputError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        _check_float("temperature", self.temperature, 0.0, math.inf)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InputError(f"SamplingParams.top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 1e6, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        stop = _as_tuple("stop", self.stop, str)
        if any(s == "" for s in stop):
            raise InputError("SamplingParams.stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        stop_ids = _as_tuple("stop_token_ids", self.stop_token_ids, int)
        if any(t < 0 for t in stop_ids):
            raise InputError(f"SamplingParams.stop_token_ids must be ids >= 0, got {list(stop_ids)!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise InputError(
                f"SamplingParams.skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            if (
                isinstance(self.seed, bool)
                or not isinstance(self.seed, int)
                or not 0 <= self.seed < SEED_LIMIT
            ):
                raise InputError(
                    f"SamplingParams.seed must be None or an int in 0..2**64-1, got {self.seed!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one step: the sampled token's, and the `k` most likely (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # one per row; None where the row did not ask
