"""What a request produced, and how one completion's tokens become it.

The engine knows tokens; a user wants text. `CompletionTracker` follows one sequence: it
decodes each new token incrementally (UTF-8 characters split across tokens wait for their last
byte), leaves special tokens out of the text (unless `skip_special_tokens=False`), finds `stop`
strings in the decoded text even when they span tokens, and holds back the last
`len(longest stop) - 1` characters of a running stream so that a stop string is never half-sent.
The final EOS or stop token stays in `token_ids` but not in the text; a stop string is cut from
the text. Special tokens that are shown (`skip_special_tokens=False`) are set apart from the
text beside them by one space each side, unless `spaces_between_special_tokens=False` (vLLM's
join of special tokens and the text between them).

Finish reasons are one vocabulary for every front end, vLLM's and OpenAI's: "stop" (EOS, a stop
token or a stop string, with `stop_reason` None, the token id or the string), "length", and
"abort" for a cancelled request. (The engine's own `TokenEvent`s say "eos" | "stop" | "length",
or "grammar" when a constrained request's grammar is complete: "stop" with its last token kept
in the text; this module is where they become the vocabulary above.)
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from ..request.sampling_params import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class CompletionMetrics:
    """When one completion's tokens came, on the `time.perf_counter` clock."""

    ttft_s: float  # from the request's submission to its first token (0 before any token)
    decode_tokens_per_s: float  # the tokens after the first over the time they took (0 for one token)


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str | None  # None when the model has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    logprobs: list[TokenLogprobs] | None = None  # one per token when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None
    metrics: CompletionMetrics | None = None


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: `outputs` holds its n completions; `text`, `token_ids`,
    `finish_reason`, `logprobs` and `metrics` are those of the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None: not run)
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (vLLM's shape;
    # None when not asked for, or when the request ended before its first token)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> CompletionMetrics | None:
        return self.outputs[0].metrics


@dataclass(frozen=True)
class Update:
    """What one engine token added to one completion: the text it shows now (possibly empty),
    the token, its logprobs, and the finish reason once the completion has ended."""

    index: int  # the completion's index among its request's completions
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # with the completion's first token, when its parameters ask for prompt_logprobs
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class Detokenizer:
    """How a model's tokens become text: its tokenizer (None: token ids only) and the tokens that
    end a turn (their `stop_reason` is None, as EOS's)."""

    tokenizer: object | None
    eos_token_ids: frozenset[int]
    special_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        tok = self.tokenizer
        special = frozenset(tok.special_tokens.values()) if tok is not None else frozenset()
        object.__setattr__(self, "special_ids", special)

    def completion(self, index: int, params: SamplingParams) -> CompletionTracker:
        return CompletionTracker(index, params, self)


class CompletionTracker:
    """Follows one engine sequence; `add()` takes each new token and returns its `Update`."""

    def __init__(self, index: int, params: SamplingParams, detokenizer: Detokenizer):
        self.index = index
        self.params = params
        self.tokenizer = detokenizer.tokenizer if params.detokenize else None
        self.eos_token_ids = detokenizer.eos_token_ids
        self.hidden_ids = detokenizer.special_ids if params.skip_special_tokens else frozenset()
        # spaces_between_special_tokens: a shown special token and the text beside it are joined
        # by a space (None: nothing shown yet; else whether the last piece shown was special)
        self.spaced_ids = detokenizer.special_ids if params.spaces_between_special_tokens else frozenset()
        self._last_special: bool | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.t_submit: float | None = None  # set when the engine queued it
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.num_cached_tokens: int | None = None  # from the engine's first event for it
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # from the same event
        self.t_scheduled: float | None = None  # when its sequence first joined the batch (the engine's)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._sent = 0  # characters of _text already handed out
        self._searched = 0  # _text[:_searched] holds no stop string start that could still match
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str | None:
        """The decoded text; "" with detokenize=False, None when there is no tokenizer."""
        if not self.params.detokenize:
            return ""
        return self._text if self.tokenizer is not None else None

    def add(
        self,
        token_id: int,
        engine_reason: str | None,
        logprobs: TokenLogprobs | None = None,
        now: float = 0.0,
        prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None,
    ) -> Update:
        """Record one token (with the engine's finish reason, if it ended the sequence; `now` is
        when it came; `prompt_logprobs` come with the first token). After it returns with
        `finished` set and `engine_reason` None, the caller must abort the engine's sequence (a
        stop string ended it)."""
        if self.finished:
            raise RuntimeError(f"completion {self.index} got a token after it finished")
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        self.token_ids.append(token_id)
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if engine_reason == "length":
            self.finish_reason = "length"
        elif engine_reason == "grammar":  # the output is complete; its last token is text
            self.finish_reason = "stop"
        elif engine_reason in ("eos", "stop"):
            self.finish_reason = "stop"
            self.stop_reason = None if token_id in self.eos_token_ids else token_id
        elif engine_reason is not None:
            self.finish_reason = engine_reason
        ends_on_token = engine_reason in ("eos", "stop")
        if self.tokenizer is not None:
            if not ends_on_token and token_id not in self.hidden_ids:
                self._show(token_id)
            if self.params.stop and len(self.token_ids) >= self.params.min_tokens:
                self._find_stop()
            else:  # as vLLM: no stop string ends a completion before min_tokens
                self._searched = len(self._text)
            if self.finished and not isinstance(self.stop_reason, str):
                self._text += self._decoder.decode(b"", final=True)  # a cut-off character shows as U+FFFD
        shown = (logprobs,) if logprobs is not None else ()
        return Update(self.index, self._take(), (token_id,), shown, self.finish_reason, self.stop_reason,
                      prompt_logprobs)  # fmt: skip

    def _show(self, token_id: int) -> None:
        special = token_id in self.spaced_ids
        if self._last_special is not None and (special or self._last_special):
            self._text += self._decoder.decode(b"", final=True) + " "  # a pending partial character ends
        self._text += self._decoder.decode(self.tokenizer.token_bytes(token_id))
        self._last_special = special

    def _find_stop(self) -> None:
        text, start = self._text, max(0, self._searched - self._hold)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s, start)) >= 0]
        if hits:
            pos, stop = min(hits)
            self._text = text[: pos + len(stop)] if self.params.include_stop_str_in_output else text[:pos]
            self.finish_reason, self.stop_reason = "stop", stop
        self._searched = len(self._text)

    def _take(self) -> str:
        end = len(self._text) if self.finished else max(self._sent, len(self._text) - self._hold)
        piece = self._text[self._sent : end]
        self._sent = end
        return piece

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

    def metrics(self) -> CompletionMetrics | None:
        if self.t_submit is None:
            return None
        first = self.t_first if self.t_first is not None else self.t_submit
        span = (self.t_last or first) - first
        n_decode = len(self.token_ids) - 1
        return CompletionMetrics(
            ttft_s=first - self.t_submit,
            decode_tokens_per_s=n_decode / span if n_decode > 0 and span > 0 else 0.0,
        )

    def output(self) -> CompletionOutput:
        cum = None
        if self.logprobs is not None:
            cum = sum(lp.logprob for lp in self.logprobs)
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=cum,
            metrics=self.metrics(),
        )
