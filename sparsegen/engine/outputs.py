"""What one completion produced, tracked above the token-level engine.

The engine knows tokens; a user wants text. `CompletionTracker` follows one sequence: it
decodes the new token incrementally (UTF-8 characters split across tokens wait for their last
byte), leaves special tokens out of the text, finds `stop` strings in the decoded text even when
they span tokens, and holds back the last `len(longest stop) - 1` characters of a running
stream so that a stop string is never half-sent. The final EOS or stop token stays in
`token_ids` but not in the text; a stop string is cut from the text.

Finish reasons follow vLLM and OpenAI: "stop" (EOS, a stop token or a stop string, with
`stop_reason` None, the token id or the string) and "length"; "abort" for a cancelled request.
"""

from __future__ import annotations

import codecs
import dataclasses
from dataclasses import dataclass

from .sampling_params import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str | None  # None when the model has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    logprobs: list[TokenLogprobs] | None = None  # one per token when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: `outputs` holds its n completions; `text`, `token_ids`,
    `finish_reason` and `logprobs` are those of the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

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


class CompletionTracker:
    """Follows one engine sequence; `add()` takes each new token and returns the text to show."""

    def __init__(
        self,
        index: int,
        params: SamplingParams,
        tokenizer,
        eos_token_ids: frozenset[int],
        special_ids: frozenset[int],
    ):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = special_ids
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
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
        return self._text if self.tokenizer is not None else None

    def add(self, token_id: int, engine_reason: str | None, logprobs: TokenLogprobs | None = None) -> str:
        """Record one token (with the engine's finish reason, if it ended the sequence); returns
        the newly shown text. After it returns with `finished` set and `engine_reason` None, the
        caller must abort the engine's sequence (a stop string ended it)."""
        if self.finished:
            raise RuntimeError(f"completion {self.index} got a token after it finished")
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if engine_reason == "length":
            self.finish_reason = "length"
        elif engine_reason in ("eos", "stop"):
            self.finish_reason = "stop"
            self.stop_reason = None if token_id in self.eos_token_ids else token_id
        elif engine_reason is not None:
            self.finish_reason = engine_reason
        ends_on_token = engine_reason in ("eos", "stop")
        if self.tokenizer is not None:
            if not ends_on_token and token_id not in self.special_ids:
                self._text += self._decoder.decode(self.tokenizer.token_bytes(token_id))
            if self.params.stop and len(self.token_ids) >= self.params.min_tokens:
                self._find_stop()
            else:  # as vLLM: no stop string ends a completion before min_tokens
                self._searched = len(self._text)
            if self.finished and not isinstance(self.stop_reason, str):
                self._text += self._decoder.decode(b"", final=True)  # a cut-off character shows as U+FFFD
        return self._take()

    def _find_stop(self) -> None:
        text, start = self._text, max(0, self._searched - self._hold)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s, start)) >= 0]
        if hits:
            pos, stop = min(hits)
            self._text = text[:pos]
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
        )


class StopStrings:
    """Stop strings for callers of `LLMEngine.generate` (the `generate` command): pass it as
    `on_token`; it aborts a sequence whose text reached a stop string, returns the text each
    token adds (held back near a possible stop string), and `apply()` fixes up the results."""

    def __init__(self, engine, tokenizer, params: list[SamplingParams], eos_token_ids: frozenset[int]):
        special = frozenset(tokenizer.special_tokens.values())
        self.engine = engine
        self.trackers = [
            CompletionTracker(i, p, tokenizer, eos_token_ids, special) for i, p in enumerate(params)
        ]

    def __call__(self, event) -> str:
        t = self.trackers[event.index]
        if t.finished:
            return ""
        piece = t.add(event.token_id, event.finish_reason, event.logprobs)
        if t.finished and event.finish_reason is None:
            self.engine.abort(event.request_id)
        return piece

    def apply(self, results: list) -> list:
        """GenerationResults with the stop-string cut: text and output_ids end there, reason "stop"."""
        out = []
        for res, t in zip(results, self.trackers, strict=True):
            if isinstance(t.stop_reason, str):
                res = dataclasses.replace(
                    res, output_ids=list(t.token_ids), text=t.text, finish_reason="stop"
                )
            out.append(res)
        return out
