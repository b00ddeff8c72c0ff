"""llguidance over sparsegen's tokenizers (`engine.grammar`): the first-token mask of a fixed
string against the tokens whose bytes start it (by hand, per tokenizer), and compile errors of
bad or adversarial schemas, regexes and grammars: typed, named, and in bounded time."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from helpers import extras
from helpers.checkpoint import write_bpe_file

from sparsegen.errors import InputError
from sparsegen.request.structured_outputs import StructuredOutputsParams as S
from sparsegen.runner.token_mask import allowed_ids
from sparsegen.tokenizer import ByteTokenizer, load_tokenizer

extras.require("llguidance")
from sparsegen.engine import grammar  # noqa: E402

TEXT = "hello world"
COMPILE_SECONDS = 60.0  # a hang guard, far above any case (milliseconds to a few seconds under load)


def _byte_tok():
    return ByteTokenizer({"<|endoftext|>": 256, "<|user|>": 257}, 300)


def _tiktoken_tok(tmp_path):
    return load_tokenizer(write_bpe_file(tmp_path / "tiny.tiktoken"))


def _hf_tok(tmp_path):
    extras.require("tokenizers")
    extras.require("transformers")
    from helpers.hf_tokenizers import write_hf_tokenizer

    from sparsegen.llm.hf_tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(write_hf_tokenizer(tmp_path / "hf"))


def _first_mask(tok, spec: S, vocab_size: int) -> np.ndarray:
    info = grammar.tokenizer_info(tok, vocab_size, tok.eos_token_id)
    m = grammar.compile_matcher(spec, info)
    words = np.frombuffer(m.compute_bitmask(), dtype="<i4")
    return allowed_ids(words, vocab_size)


@pytest.mark.parametrize("kind", ["byte", "tiktoken", "hf"])
def test_first_mask_is_every_token_the_regex_can_start_with(kind, tmp_path):
    tok = {"byte": _byte_tok, "tiktoken": lambda: _tiktoken_tok(tmp_path), "hf": lambda: _hf_tok(tmp_path)}[
        kind
    ]()
    vocab = tok.vocab()
    width = len(vocab) + 37  # the model's logits may be wider than the tokenizer
    specials = set(tok.special_tokens.values())
    letters = set(b"abcdefghijklmnopqrstuvwxyz ")
    want = [i for i, b in enumerate(vocab) if b and i not in specials and set(b) <= letters and len(b) <= 30]
    got = _first_mask(tok, S(regex="[a-z ]{1,30}"), width).tolist()
    assert got == want
    assert len([i for i in want if len(vocab[i]) > 1]) >= (0 if kind == "byte" else 3)  # merged tokens too


def test_a_forced_text_takes_its_canonical_tokens(tmp_path):
    tok = _tiktoken_tok(tmp_path)
    first = _first_mask(tok, S(regex=re.escape(TEXT)), len(tok.vocab())).tolist()
    assert [tok.vocab()[i] for i in first] == [b"hello"]  # the BPE's own first token of the text


def test_walking_the_masks_spells_a_choice(tmp_path):
    tok = _tiktoken_tok(tmp_path)
    info = grammar.tokenizer_info(tok, len(tok.vocab()), tok.eos_token_id)
    m = grammar.compile_matcher(S(choice=["hello world", "help"]), info)
    out, rng = [], np.random.default_rng(0)
    while not m.is_stopped():
        ids = allowed_ids(np.frombuffer(m.compute_bitmask(), dtype="<i4"), len(tok.vocab()))
        t = int(rng.choice(ids))
        assert m.consume_token(t)
        out.append(t)
        if t == tok.eos_token_id:
            break
    assert tok.decode([t for t in out if t != tok.eos_token_id]) in ("hello world", "help")


def test_no_tokenizer_or_eos_is_an_input_error():
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        grammar.tokenizer_info(None, 300, 256)
    with pytest.raises(InputError, match="EOS token id"):
        grammar.tokenizer_info(_byte_tok(), 300, None)


def _deep_object(n: int) -> str:
    return '{"type":"object","properties":{"a":' * n + '{"type":"integer"}' + "}}" * n


def _wide(n: int) -> dict:
    props = {f"p{i}": {"enum": [f"v{j}" for j in range(20)]} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


BAD = [
    (S(json={"type": "nope"}), "json does not compile: .*nope"),
    (S(json={"type": "integer", "minimum": 5, "maximum": 3}), "minimum"),
    (S(json={"type": "string", "format": "bogus"}), "bogus"),
    (S(json={"$ref": "#/$defs/missing"}), "json does not compile"),
    (S(json=_deep_object(200)), "json cannot be read: .*recursion"),
    (S(json=_wide(5000)), "json does not compile: .*too (large|big)"),
    (S(regex="(unclosed"), "regex does not compile: .*unclosed"),
    (S(grammar="start: undefined_rule"), "grammar does not compile: .*undefined_rule"),
    (S(grammar="root ::= ("), "grammar"),
]


@pytest.mark.parametrize("spec,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_and_adversarial_grammars_fail_typed_and_bounded(spec, match):
    tok = _byte_tok()
    info = grammar.tokenizer_info(tok, 300, 256)
    start = time.perf_counter()
    with pytest.raises(InputError, match=match):
        grammar.compile_matcher(spec, info)
    assert time.perf_counter() - start < COMPILE_SECONDS


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},  # the schema is itself: any nesting of itself
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                }
            },
            "$ref": "#/$defs/n",
        },
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ],
    ids=["self", "tree", "loop"],
)
def test_recursive_refs_compile_or_fail_in_bounded_time(schema):
    _bounded(S(json=schema))


def test_an_exploding_regex_compiles_in_bounded_time():
    _bounded(S(regex="(a{50}){50}{50}"))  # 125,000 states unrolled


def _bounded(spec: S) -> None:
    tok = _byte_tok()
    info = grammar.tokenizer_info(tok, 300, 256)
    start = time.perf_counter()
    try:
        m = grammar.compile_matcher(spec, info)
    except InputError as exc:
        assert "does not compile" in str(exc)
    else:
        m.compute_bitmask()  # one mask step is bounded by the parser's fuel too
    assert time.perf_counter() - start < COMPILE_SECONDS


def test_check_compiles_without_a_tokenizer():
    grammar.check_compiles(S(json={"type": "object"}))
    with pytest.raises(InputError, match="json does not compile"):
        grammar.check_compiles(S(json={"type": "nope"}))


@pytest.mark.parametrize(
    "spec,most",
    [
        (S(json_object=True), grammar.MAX_JSON_WHITESPACE),
        (S(json_object=True, disable_any_whitespace=True), 0),
        (S(json_object=True, whitespace_pattern=" ?"), 1),
    ],
    ids=["bounded", "none", "pattern"],
)
def test_json_whitespace_between_tokens_is_bounded(spec, most):
    info = grammar.tokenizer_info(_byte_tok(), 300, 256)
    m = grammar.compile_matcher(spec, info)
    assert m.consume_token(ord("{"))
    for _ in range(most):
        assert ord(" ") in allowed_ids(np.frombuffer(m.compute_bitmask(), dtype="<i4"), 300)
        assert m.consume_token(ord(" "))
    after = allowed_ids(np.frombuffer(m.compute_bitmask(), dtype="<i4"), 300)
    assert ord(" ") not in after and ord('"') in after and ord("}") in after


def test_without_llguidance_the_error_names_the_extra(monkeypatch):
    import sys

    from sparsegen.errors import MissingExtraError

    grammar._llguidance.cache_clear()
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    try:
        with pytest.raises(MissingExtraError, match=r"sparsegen\[structured\]"):
            grammar.check_compiles(S(json_object=True))
    finally:
        monkeypatch.undo()
        grammar._llguidance.cache_clear()
    grammar.check_compiles(S(json_object=True))  # back again
