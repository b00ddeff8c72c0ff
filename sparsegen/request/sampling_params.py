"""Sampling parameters (vLLM's names and meanings) and the types a sampler returns.

`SamplingParams` checks every field when it is made, so a bad request is an InputError before
anything runs; the sampler that reads them is `runner.sampling`. Every field is bounded by what
one batched step can hold, so a value that passes here cannot fail inside a step:
- counts of tokens (`max_tokens`, `min_tokens`, `top_k`) and token ids are at most
  `MAX_TOKEN_COUNT` (sequence lengths and positions are int32 on the device; a `top_k` above
  the vocabulary keeps every token);
- `n` is at most `MAX_N` (each completion is a sequence of its own), `logprobs` and
  `prompt_logprobs` at most `MAX_LOGPROBS` (vLLM's max_logprobs), a seed is a uint64;
- floats are finite and at most `FLOAT32_MAX` (the step's parameter tensors are float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError
from ..utf8 import check_utf8
from .structured_outputs import StructuredOutputsParams, as_structured

MAX_LOGPROBS = 20  # most top-k log-probabilities a request may ask for per step
SEED_LIMIT = 2**64  # seeds are 0..2**64-1, as torch.Generator.manual_seed takes them
MAX_TOKEN_COUNT = 2**31 - 1  # token counts and ids: what an int32 holds
MAX_N = 4096  # completions per prompt
FLOAT32_MAX = 3.4028234663852886e38
MAX_REPETITION_PENALTY = 1e6
MAX_LOGIT_BIAS = 100.0  # |bias| bound (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024  # tokens one request may bias
MAX_ALLOWED_TOKEN_IDS = 2**18  # entries of allowed_token_ids (more than any vocabulary here)
# Below this temperature a row is greedy (vLLM's threshold, `_SAMPLING_EPS`): a smaller one
# would only turn the distribution into its argmax through float32 overflow.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if not (_is_int(value) and lo <= value <= hi):
        raise InputError(f"SamplingParams.{name} must be an int in {lo}..{hi}, got {value!r:.80}")


def _check_float(name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise InputError(f"SamplingParams.{name} must be a finite number in {span}, got {value!r:.80}")


def _as_tuple(name: str, value, item_type: type) -> tuple:
    if value is None:
        return ()
    if item_type is str and isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise InputError(f"SamplingParams.{name} must be a list of {item_type.__name__}, got {value!r:.80}")
    for item in value:
        if not isinstance(item, item_type) or isinstance(item, bool):
            raise InputError(f"SamplingParams.{name} items must be {item_type.__name__}, got {item!r:.80}")
    return tuple(value)


def _bias_pairs(value) -> tuple:
    """A dict {token id: bias} or (id, bias) pairs -> pairs sorted by id (a duplicate id is an error)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise InputError(
                f"SamplingParams.logit_bias has {len(value)} entries, more than {MAX_LOGIT_BIAS_ENTRIES}"
            )
        value = tuple(value.items())
    if not isinstance(value, (list, tuple)):
        raise InputError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {value!r:.80}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InputError(
            f"SamplingParams.logit_bias has {len(value)} entries, more than {MAX_LOGIT_BIAS_ENTRIES}"
        )
    pairs = []
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise InputError(f"SamplingParams.logit_bias entries must be (token id, bias), got {item!r:.80}")
        pairs.append(tuple(item))
    try:
        pairs.sort(key=lambda kv: kv[0])
    except TypeError:
        raise InputError(f"SamplingParams.logit_bias keys must be int token ids, got {value!r:.80}") from None
    return tuple(pairs)


def _check_logit_processors(p: SamplingParams) -> None:
    bias = p.logit_bias
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InputError(
            f"SamplingParams.logit_bias must be at most {MAX_LOGIT_BIAS_ENTRIES} (id, bias) pairs"
        )
    last = -1
    for item in bias:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InputError(f"SamplingParams.logit_bias entries must be (token id, bias), got {item!r:.80}")
        tok, b = item
        if not (_is_int(tok) and 0 <= tok <= MAX_TOKEN_COUNT):
            raise InputError(
                f"SamplingParams.logit_bias key {tok!r:.80} is not a token id in 0..{MAX_TOKEN_COUNT}"
            )
        if tok <= last:
            raise InputError(f"SamplingParams.logit_bias lists token {tok} twice (or out of order)")
        last = tok
        _check_float(f"logit_bias[{tok}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    allowed = p.allowed_token_ids
    if allowed is None:
        return
    if not isinstance(allowed, tuple) or not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
        raise InputError(
            f"SamplingParams.allowed_token_ids must be None or 1..{MAX_ALLOWED_TOKEN_IDS} token ids, "
            f"got {allowed!r:.80}"
        )
    if not all(_is_int(t) and 0 <= t <= MAX_TOKEN_COUNT for t in allowed):
        raise InputError(
            f"SamplingParams.allowed_token_ids must be token ids in 0..{MAX_TOKEN_COUNT}, got {allowed!r:.80}"
        )


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each new token and when to stop, with vLLM's field names and meanings.

    - `n`: completions per prompt (their seeds are `seed + i` when `seed` is given).
    - `max_tokens` / `min_tokens`: at most / at least this many new tokens (EOS and the stop
      tokens are masked until `min_tokens` is reached).
    - `temperature`: 0 (or anything below GREEDY_TEMPERATURE, 1e-5, as in vLLM) is greedy.
      Unlike vLLM (1.0), the default here is greedy.
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
    - `prompt_logprobs`: `None`, or how many top log-probabilities to return for each prompt
      token (0 returns only the prompt token's own): `RequestOutput.prompt_logprobs`, one entry
      per prompt token, the first None (nothing comes before it). Such a request computes its
      whole prompt: it does not take its prefix from the prefix cache (its pages are still
      cached for others).
    - `seed`: a per-request random stream, reproducible whatever else is in the batch.
    - `skip_special_tokens`: leave special tokens (`<|user|>`, ...) out of the text.
    - `spaces_between_special_tokens`: with `skip_special_tokens=False`, a space goes between a
      special token and the text next to it (and between two special tokens), as vLLM
      (and transformers) join them; False puts nothing between them.
    - `include_stop_str_in_output`: a stop string that ended the text stays at its end.
    - `detokenize`: False returns token ids only (the text is ""); stop strings need text, so
      they are refused with it.
    - `logit_bias`: token id -> bias in [-100, 100], added to the logits before everything
      else the sampler does (a dict, or (id, bias) pairs; kept as pairs sorted by id).
    - `allowed_token_ids`: if given, every other token is masked out (after `logit_bias`).
    Token ids in these two are checked against the model's vocabulary when the engine takes
    the request (`engine.checks.check_params`).
    - `structured_outputs`: a `StructuredOutputsParams` (JSON schema, JSON object, regex, choice
      or grammar) that every token must keep the output within; the request ends ("stop") when
      the grammar is complete. `guided_decoding` is vLLM's older name for it.
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
    prompt_logprobs: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # -- logit processors (runner.sampling applies them per row, batched) --
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # -- constrained decoding (engine.structured_output) --
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older spelling of the same

    def __post_init__(self) -> None:
        self._fold_structured()
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _as_tuple("allowed_token_ids", self.allowed_token_ids, int)
            object.__setattr__(self, "allowed_token_ids", allowed)
        self.validate()

    def validate(self) -> None:
        """Check every field against what one batched step can hold (InputError naming it);
        `engine.checks.check_params` runs it again on whatever reaches the engine."""
        _check_int("n", self.n, 1, MAX_N)
        _check_int("max_tokens", self.max_tokens, 1, MAX_TOKEN_COUNT)
        _check_int("min_tokens", self.min_tokens, 0, MAX_TOKEN_COUNT)
        if self.min_tokens > self.max_tokens:
            raise InputError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        _check_float("temperature", self.temperature, 0.0, FLOAT32_MAX)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not (_is_int(self.top_k) and -1 <= self.top_k <= MAX_TOKEN_COUNT):
            raise InputError(
                f"SamplingParams.top_k must be an int in -1..{MAX_TOKEN_COUNT} (0 or -1 = off), "
                f"got {self.top_k!r:.80}"
            )
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        stop = self.stop
        if not isinstance(stop, tuple) or not all(isinstance(s, str) for s in stop):
            raise InputError(f"SamplingParams.stop must be a tuple of str, got {stop!r:.80}")
        if any(s == "" for s in stop):
            raise InputError("SamplingParams.stop strings must not be empty")
        for i, s in enumerate(stop):
            check_utf8(s, f"SamplingParams.stop[{i}]", InputError)
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_COUNT for t in ids):
            raise InputError(
                f"SamplingParams.stop_token_ids must be token ids in 0..{MAX_TOKEN_COUNT}, got {ids!r:.80}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r:.80}")
        if not isinstance(self.skip_special_tokens, bool):
            raise InputError(
                f"SamplingParams.skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )
        for name in ("include_stop_str_in_output", "detokenize", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r:.80}")
        if not self.detokenize and self.stop:
            raise InputError(
                "SamplingParams.stop needs the text: stop strings cannot be used with detokenize=False"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise InputError(
                f"SamplingParams.seed must be None or an int in 0..2**64-1, got {self.seed!r:.80}"
            )

        _check_logit_processors(self)
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, StructuredOutputsParams):
                raise InputError(
                    f"SamplingParams.{name} must be a StructuredOutputsParams, got {value!r:.80}"
                )
        if self.guided_decoding is not None and self.guided_decoding != self.structured_outputs:
            raise InputError("SamplingParams.guided_decoding and structured_outputs disagree; give one")

    def _fold_structured(self) -> None:
        """structured_outputs and guided_decoding as params (a dict of fields is taken too), the
        one given copied into the other."""
        so = as_structured(self.structured_outputs, "structured_outputs")
        gd = as_structured(self.guided_decoding, "guided_decoding")
        if so is not None and gd is not None and so != gd:
            raise InputError("SamplingParams.guided_decoding and structured_outputs disagree; give one")
        object.__setattr__(self, "structured_outputs", so or gd)
        object.__setattr__(self, "guided_decoding", gd)

    @property
    def has_structured_output(self) -> bool:
        return self.structured_outputs is not None

    @property
    def has_logit_processors(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_TEMPERATURE take the argmax (top_k, top_p and min_p
        change nothing then)."""
        return self.temperature < GREEDY_TEMPERATURE

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
    rank: int | None = None  # the token's rank in the vocabulary (1: most likely); prompt tokens only


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens `first`, `first + 1`, ... of sequence `seq_id`, from
    one prefill chunk's logits (each token scored by the position before it)."""

    seq_id: int
    first: int  # index in the prompt of the first token scored (>= 1)
    items: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # one per row; None where the row did not ask
    # rows whose sampling failed, with why ("TypeName: message"); their tokens are meaningless
    failed: tuple[tuple[int, str], ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # chunks of sequences that asked for them
