"""What a constrained request asks its output to be (vLLM's `StructuredOutputsParams`).

Exactly one of:
- `json`: a JSON schema (a dict, or its JSON text), the output is JSON that validates against it;
- `json_object`: True, the output is any JSON object;
- `regex`: the output matches this regular expression (whole);
- `choice`: the output is exactly one of these strings;
- `grammar`: a context-free grammar in Lark syntax (or llama.cpp's GBNF), as llguidance reads it.

`disable_any_whitespace` (vLLM's meaning): JSON outputs take no whitespace between their tokens
(`{"a":1}`), instead of up to `engine.grammar.MAX_JSON_WHITESPACE` characters of it.
`whitespace_pattern`: a regex for the whitespace between JSON tokens instead (vLLM's too). The older spelling `GuidedDecodingParams` (vLLM
before 0.10) is the same class with an ignored `backend` name.

Everything is checked here, without the grammar library: types, bounds, and that a schema is
JSON. Whether the grammar compiles is checked when the engine takes the request
(`engine.grammar`), with llguidance. A schema dict is kept as its JSON text, so the parameters
are frozen and hashable like every `SamplingParams`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InputError
from ..utf8 import check_utf8

MAX_GRAMMAR_CHARS = 1 << 20  # a schema's JSON text, a regex or a grammar
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 1 << 20  # all choices together
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _schema_text(value) -> str:
    """A schema (dict, bool or JSON text) as JSON text that parses to an object or a bool."""
    if isinstance(value, str):
        text = value
        try:
            parsed = json.loads(text)
        except RecursionError:
            raise InputError("structured_outputs.json is nested too deeply to parse") from None
        except ValueError as exc:
            raise InputError(f"structured_outputs.json is not JSON text: {exc}") from None
    elif isinstance(value, (dict, bool)):
        parsed = value
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except RecursionError:
            raise InputError("structured_outputs.json is nested too deeply to write as JSON") from None
        except (TypeError, ValueError) as exc:
            raise InputError(f"structured_outputs.json is not a JSON value: {exc}") from None
    else:
        raise InputError(
            f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got {type(value).__name__}"
        )
    if not isinstance(parsed, (dict, bool)):
        raise InputError(f"structured_outputs.json must be a JSON object (a schema), got {text!r:.80}")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InputError(f"structured_outputs.json is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    check_utf8(text, "structured_outputs.json", InputError)
    return text


def _text(name: str, value, limit: int = MAX_GRAMMAR_CHARS) -> str:
    if not isinstance(value, str):
        raise InputError(
            f"structured_outputs.{name} must be a str, got {type(value).__name__}: {value!r:.80}"
        )
    if not value:
        raise InputError(f"structured_outputs.{name} must not be empty")
    if len(value) > limit:
        raise InputError(f"structured_outputs.{name} is {len(value)} characters; at most {limit}")
    check_utf8(value, f"structured_outputs.{name}", InputError)
    return value


def _choices(value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InputError(f"structured_outputs.choice must be a list of str, got {value!r:.80}")
    if not 1 <= len(value) <= MAX_CHOICES:
        raise InputError(f"structured_outputs.choice must hold 1..{MAX_CHOICES} strings, got {len(value)}")
    for i, c in enumerate(value):
        if not isinstance(c, str) or not c:
            raise InputError(f"structured_outputs.choice[{i}] must be a non-empty str, got {c!r:.80}")
        check_utf8(c, f"structured_outputs.choice[{i}]", InputError)
    if sum(map(len, value)) > MAX_CHOICE_CHARS:
        raise InputError(f"structured_outputs.choice holds more than {MAX_CHOICE_CHARS} characters")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output (see the module docstring); checked when made."""

    json: str | None = None  # a dict is kept as its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InputError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.json_object is not None and self.json_object is not True:
            raise InputError(
                f"structured_outputs.json_object must be True or None, got {self.json_object!r:.40}"
            )
        if self.regex is not None:
            _text("regex", self.regex)
        if self.grammar is not None:
            _text("grammar", self.grammar)
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise InputError(
                f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r:.40}"
            )
        if self.whitespace_pattern is not None:
            _text("whitespace_pattern", self.whitespace_pattern, 4096)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True, kw_only=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older spelling (before 0.10); `backend` is accepted and ignored (llguidance runs)."""

    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise InputError(f"guided_decoding.backend must be a str, got {self.backend!r:.40}")
        super().__post_init__()


def as_structured(value, name: str) -> StructuredOutputsParams | None:
    """None, a StructuredOutputsParams, or a dict of its fields -> the params (InputError else)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(StructuredOutputsParams.__dataclass_fields__)
        if unknown:
            raise InputError(
                f"SamplingParams.{name} has unknown fields: {', '.join(sorted(map(str, unknown)))}"
            )
        return StructuredOutputsParams(**value)
    raise InputError(
        f"SamplingParams.{name} must be a StructuredOutputsParams (or a dict of its fields), "
        f"got {type(value).__name__}"
    )
