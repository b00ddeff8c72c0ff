"""Tokenizers: local BPE files only, special tokens, and a vocabulary that is bytes throughout."""

from __future__ import annotations

import json

import pytest
from helpers.checkpoint import write_bpe_file

from sparsegen.models.config import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE
from sparsegen.tokenizer import (
    PHI3SMALL_SPECIAL_TOKENS,
    ByteTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer,
    read_tiktoken_ranks,
)


@pytest.fixture(autouse=True)
def _private_tiktoken_cache(tmp_path, monkeypatch):
    """tiktoken copies every file it reads into its cache; keep those copies in tmp_path."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


def test_bpe_from_a_local_file_round_trips_and_merges(tmp_path):
    tok = load_tokenizer(write_bpe_file(tmp_path / "tiny.tiktoken"))
    assert tok.encode("hello world") == [259, 263]
    text = "héllo <|user|> wörld\n\t123 ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.special_tokens["<|endoftext|>"] == 264 and tok.eos_token_id == 264
    assert tok.encode("<|endoftext|>") == [264]


def test_vocab_is_bytes_and_sorts(tmp_path):
    for tok in (
        load_tokenizer(write_bpe_file(tmp_path / "tiny.tiktoken")),
        ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE),
    ):
        vocab = tok.vocab()
        assert len(vocab) == tok.vocab_size
        assert all(type(v) is bytes for v in vocab)
        sorted(vocab)  # a str among bytes would raise TypeError here
        assert vocab[tok.eos_token_id] == b"<|endoftext|>"


def test_folder_with_tokenizer_config(tmp_path):
    write_bpe_file(tmp_path / "tiny.tiktoken")
    added = {"300": {"content": "<|endoftext|>"}, "301": {"content": "<|end|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = load_tokenizer(tmp_path, vocab_size=320)
    assert tok.eos_token_id == 300 and tok.vocab_size == 320
    assert tok.encode("<|end|>") == [301]
    assert tok.vocab()[310] == b""


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(TokenizerError, match="no .tiktoken file"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("aGk= 0\nnot-base64!! x\n")
    with pytest.raises(TokenizerError, match=r"bad\.tiktoken is not a \.tiktoken file.*not-base64"):
        read_tiktoken_ranks(bad)
    tok = ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE)
    with pytest.raises(TokenizerError, match="token id 999"):
        tok.decode([999])


def test_byte_tokenizer_specials_and_dummies():
    tok = ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE)
    assert tok.encode("a<|user|>b") == [97, 258, 98]
    assert tok.decode([104, 105, 260]) == "hi<|end|>"
    assert tok.dummy_token_indices == tuple(range(261, 272))


def test_streaming_decoder_waits_for_whole_characters():
    tok = ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE)
    piece = tok.stream_decoder()
    out = [piece(b) for b in "é✓".encode()]
    assert "".join(out) == "é✓" and out[0] == ""


def test_phi3small_special_token_table():
    s = PHI3SMALL_SPECIAL_TOKENS
    assert (s["<|endoftext|>"], s["<|system|>"], s["<|user|>"], s["<|assistant|>"], s["<|end|>"]) == (
        100257, 100261, 100262, 100263, 100266,
    )  # fmt: skip
    assert len(set(s.values())) == len(s) and max(s.values()) == 100351
    ranks = {bytes([i]): i for i in range(256)}
    tok = TiktokenTokenizer(ranks, s, vocab_size=100352)
    dummies = tok.dummy_token_indices
    assert dummies[:6] == (100256, 100258, 100259, 100260, 100264, 100265)
    assert 100257 not in dummies and 100266 not in dummies and 100276 in dummies
    assert len(dummies) == (100352 - 100256) - 5  # every id above the ranks but the five in use


def test_cl100k_folder_merges_tokenizer_config_over_the_phi3small_table(tmp_path):
    from sparsegen.tokenizer import CL100K_NUM_RANKS, _special_tokens_for

    assert _special_tokens_for(tmp_path, CL100K_NUM_RANKS) == PHI3SMALL_SPECIAL_TOKENS
    added = {"100257": {"content": "<|endoftext|>"}, "100300": {"content": "<|custom|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    specials = _special_tokens_for(tmp_path, CL100K_NUM_RANKS)
    assert specials["<|custom|>"] == 100300 and specials["<|user|>"] == 100262
    assert len(set(specials.values())) == len(specials)  # the dummy that held 100300 gave way
