"""Grammars through llguidance (the `[structured]` extra, imported on first use).

- `tokenizer_info(tokenizer, vocab_size, eos)`: llguidance's view of a sparsegen tokenizer
  (`ByteTokenizer`, `TiktokenTokenizer`, `HFTokenizer`: anything with `vocab()` as bytes per
  id, `special_tokens` and `encode`), over the model's whole logits width (ids the tokenizer
  lacks are empty and never allowed). Built once per engine: it walks the vocabulary.
- `grammar_of(spec)`: a `StructuredOutputsParams` as llguidance's grammar text.
- `compile_matcher(spec, info)`: a fresh matcher, its first mask computed (that builds its
  lexer), or InputError naming why the schema, regex or grammar does not compile (checked
  before the request is queued).

Compilation is bounded by `LIMITS` (llguidance's fuel and size limits): a huge or deeply nested
schema, or a regex whose automaton explodes, is an error in bounded time, never a hang.
"""

from __future__ import annotations

import json
from functools import cache

from ..errors import InputError, MissingExtraError
from ..request.structured_outputs import StructuredOutputsParams

MAX_ERROR_CHARS = 600


@cache
def _llguidance():
    try:
        import llguidance
    except ImportError as exc:
        raise MissingExtraError(
            f"structured output needs llguidance ({exc}): pip install 'sparsegen[structured]'"
        ) from None
    return llguidance


def limits():
    """llguidance's parser limits for every grammar here (its defaults: the same grammars compile
    as under vLLM's guidance backend), with terse error messages."""
    return _llguidance().LLParserLimits(verbose_errors=False)


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: token bytes by id, EOS, special ids, encode."""

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        tokens = list(tokenizer.vocab())[:vocab_size]
        self.tokens = tokens + [b""] * (vocab_size - len(tokens))
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = sorted(i for i in tokenizer.special_tokens.values() if i < vocab_size)
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._encode(text))


def tokenizer_info(tokenizer, vocab_size: int, eos: int):
    """llguidance's LLTokenizer for `tokenizer` over `vocab_size` ids, `eos` its end token."""
    llg = _llguidance()
    if tokenizer is None:
        raise InputError("structured output needs the model's tokenizer, and this engine has none")
    if eos is None or not 0 <= eos < vocab_size:
        raise InputError(f"structured output needs an EOS token id in 0..{vocab_size - 1}, got {eos!r}")
    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, eos)))


# Whitespace between two JSON tokens, unless the request says otherwise: at most this many of
# space, newline, tab, CR (a newline and 4-space indents 5 levels deep fit). vLLM allows any
# amount; a model (greedy, or a random one) can then emit whitespace until max_tokens, which a
# bound turns into a finite detour.
MAX_JSON_WHITESPACE = 24
JSON_WHITESPACE = f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"


def _json_options(spec: StructuredOutputsParams) -> dict:
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern or JSON_WHITESPACE}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec` (InputError if llguidance cannot even read it)."""
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind = spec.kind
    try:
        if kind == "json":
            return matcher.grammar_from_json_schema(spec.json, overrides=_json_options(spec))
        if kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', overrides=_json_options(spec))
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(list(spec.choice)))
        return llg.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError, RecursionError) as exc:
        raise InputError(f"structured_outputs.{kind} cannot be read: {str(exc)[:MAX_ERROR_CHARS]}") from None


def compile_matcher(spec: StructuredOutputsParams, info):
    """A matcher for `spec` over the tokenizer `info` (InputError naming the problem)."""
    llg = _llguidance()
    grammar = grammar_of(spec)
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, info, limits=limits())
    if error:
        raise InputError(f"structured_outputs.{spec.kind} does not compile: {messages[0][:MAX_ERROR_CHARS]}")
    matcher = llg.LLMatcher(info, grammar, log_level=0, limits=limits())
    matcher.compute_bitmask()  # the first step builds the lexer: its limits are hit here, not in a step
    if matcher.is_error():
        raise InputError(
            f"structured_outputs.{spec.kind} does not compile: {first_error(matcher.get_error())}"
        )
    return matcher


def check_compiles(spec: StructuredOutputsParams) -> None:
    """The grammar checked without a tokenizer (what a front end can check before the engine)."""
    llg = _llguidance()
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar_of(spec), None, limits=limits())
    if error:
        raise InputError(f"structured_outputs.{spec.kind} does not compile: {messages[0][:MAX_ERROR_CHARS]}")


def first_error(message: str) -> str:
    """llguidance's error without its appended parser state."""
    return message.split("\n<state>")[0][:MAX_ERROR_CHARS]
