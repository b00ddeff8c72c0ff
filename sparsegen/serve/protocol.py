"""The OpenAI request bodies the server takes, checked strictly, and their SamplingParams.

Bodies are parsed with pydantic in strict mode (no "0.5" for a number, no 1.0 for an int, no
NaN) and the models refuse unknown fields; the app then accepts them (logged once per name)
unless it runs with --strict, where a typo is a 400 naming the field. Every number is bounded as `SamplingParams` bounds it (what one batched step holds),
so a value the engine could not represent is a 400 naming its field, never a failed step.
OpenAI fields that change nothing here (`metadata`, `store`, `service_tier`,
`reasoning_effort`, `user`, `parallel_tool_calls`) are accepted as vLLM accepts them; other
unknown fields are the app's to accept or refuse (`unknown_fields.py`).
Besides OpenAI's fields, vLLM's extras are accepted (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos`), as the openai client sends them through
`extra_body`, and `allowed_token_ids`. `logit_bias` takes OpenAI's shape (token id as a
string -> bias in [-100, 100]); its ids are checked against the model's vocabulary when the
engine takes the request. `response_format` (text, json_object, json_schema) and vLLM's
`structured_outputs` / `guided_*` fields constrain the output (`response_format.py`). Features
the server does not have (`suffix`, tools) are refused by name. `echo` with `logprobs` scores the
prompt (the prompt's log-probabilities come first), and `max_tokens: 0` is allowed with `echo` only.
vLLM's `prompt_logprobs` (0..MAX_LOGPROBS, whole responses only) returns each prompt token's
log-probability, rank and top k in vLLM's shape (`responses.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import RequestError
from ..request.sampling_params import (
    FLOAT32_MAX,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_COUNT,
    SEED_LIMIT,
    SamplingParams,
)
from .response_format import structured_outputs_of

MAX_N = 16  # completions per request
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256
MAX_PROMPTS = 256  # prompts in one /v1/completions request

StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKEN_COUNT)]
EchoTokenCount = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]  # 0: echo the prompt, generate nothing


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (with include_usage)


class _SamplingFields(_Strict):
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
        ]
        | None
    ) = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKEN_COUNT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's extra fields
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    return_token_ids: bool = False  # sparsegen (and recent vLLM): each choice also lists its token ids
    # vLLM's extra: the top k log-probabilities of each prompt token (not with stream, as vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI fields vLLM accepts and that change nothing here
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # output constraints (response_format.py)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _refuse_unsupported(self) -> None:
        self._bias_pairs()
        structured_outputs_of(self)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs are not available with stream: true", "prompt_logprobs")

    def _bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias's keys as token ids (decimal strings, as OpenAI sends them)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_TOKEN_COUNT):
                raise RequestError(f"logit_bias key {key!r:.40} is not a token id", "logit_bias")
            pairs.append((int(key), bias))
        if len({t for t, _ in pairs}) != len(pairs):
            raise RequestError("logit_bias names one token id twice", "logit_bias")
        return tuple(sorted(pairs))

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.min_tokens > max_tokens:
            raise RequestError(
                f"min_tokens ({self.min_tokens}) is larger than max_tokens ({max_tokens})", "min_tokens"
            )
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs,
            seed=self.seed,
            logit_bias=self._bias_pairs(),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            structured_outputs=structured_outputs_of(self),
        )


Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
    ]
)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: EchoTokenCount | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS (token ids: none)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @property
    def echo_only(self) -> bool:
        """Echo the prompt (and score it) without generating (`max_tokens: 0`)."""
        return self.echo and self.max_tokens == 0

    def check(self) -> None:
        self._refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise RequestError(
                "max_tokens 0 is only allowed with echo: true (to score the prompt)", "max_tokens"
            )
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's answer to this call
    tool_calls: list[dict] | None = None  # an assistant message's calls

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict:
        """The message as `llm.chat` takes it (`chat.check_messages` maps developer to system)."""
        out = {"role": self.role, "content": self.text() if self.content is not None else None}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM's extra: the reply starts with the message it continues
    add_special_tokens: bool = False  # vLLM's: the template writes the BOS; true adds the tokenizer's too
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        self._refuse_unsupported()
        if self.tools:
            raise RequestError("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise RequestError("tool_choice is not supported", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise RequestError("max_tokens and max_completion_tokens disagree", "max_completion_tokens")

    def conversation(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def echo_text(self) -> str:
        """What `echo` puts before the reply (vLLM's meaning): the last message's content when
        the reply continues it, that is when no generation prompt opens a new assistant turn
        (`add_generation_prompt: false`) or the last message is the assistant's own; else ""."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.text()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
