"""A checkpoint's `tokenizer.json`, read by Hugging Face's `tokenizers` library (the `[model]`
extra, imported on first use), with a vocabulary of bytes like every sparsegen tokenizer.

- Byte-level BPE (GPT-2, Llama-3, Qwen, gpt-oss): each token's characters map back to bytes
  through GPT-2's byte <-> printable-character table.
- SentencePiece-style (Llama-2, Mistral, Gemma): `▁` is a space and a byte-fallback token
  `<0xNN>` is the byte NN.
- Added tokens (special or not) are their content's UTF-8; `special_tokens` holds those marked
  special (what `skip_special_tokens` hides).

`decode` and `stream_decoder` join those bytes and decode UTF-8, so a character split across
tokens comes out whole once its last byte arrives; `decode` also drops the leading space a
Llama-2-style `Strip` decoder removes (a stream keeps it: it is the text between tokens). `encode(text)` adds no special tokens (a
chat template writes its own BOS); `encode(text, add_special_tokens=True)` runs the tokenizer's
post-processor (a BOS for Llama), as `AutoTokenizer(text)` does.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import jsonio
from ..errors import MissingExtraError, TokenizerError
from ..folders import contained_file
from ..tokenizer import MAX_TOKEN_ID, _BytesVocabTokenizer, _check_text

MAX_TOKENIZER_JSON_BYTES = 256 << 20  # the largest published tokenizer.json files are ~35 MB
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for (256 entries)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise MissingExtraError(
            f"reading tokenizer.json needs the tokenizers library ({exc}): pip install 'sparsegen[model]'"
        ) from None
    return tokenizers


def _kinds(node) -> set[str]:
    """Every `type` named in a tokenizer.json component (nested Sequences included)."""
    if isinstance(node, dict):
        out = {node["type"]} if isinstance(node.get("type"), str) else set()
        for value in node.values():
            out |= _kinds(value)
        return out
    if isinstance(node, list):
        return set().union(*map(_kinds, node)) if node else set()
    return set()


def _nodes(node, kind: str) -> list[dict]:
    """The components of type `kind` in a tokenizer.json component (nested Sequences included)."""
    if isinstance(node, dict):
        own = [node] if node.get("type") == kind else []
        return own + [n for value in node.values() for n in _nodes(value, kind)]
    if isinstance(node, list):
        return [n for value in node for n in _nodes(value, kind)]
    return []


def token_bytes_of(piece: str, byte_level: bool, byte_fallback: bool, table: dict[str, int]) -> bytes:
    """The bytes one vocabulary entry stands for."""
    if byte_level and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    if byte_fallback:
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode()


class HFTokenizer(_BytesVocabTokenizer):
    """A `tokenizers.Tokenizer` with a bytes vocabulary; `eos_token` names the end-of-text token."""

    def __init__(self, path: str | Path, eos_token: str | None = None, vocab_size: int | None = None):
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise TokenizerError(f"cannot read {path}: {exc}") from None
        if size > MAX_TOKENIZER_JSON_BYTES:
            raise TokenizerError(f"{path} is {size} bytes; at most {MAX_TOKENIZER_JSON_BYTES} are expected")
        data = jsonio.read_json_file(path, TokenizerError)
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise TokenizerError(f"{path} is not a tokenizer.json: it has no 'model' object")
        try:
            self._tok = _tokenizers().Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library's errors are untyped (a Rust panic, an Exception)
            raise TokenizerError(
                f"{path} is not a tokenizer.json the tokenizers library reads: {exc}"[:800]
            ) from None
        kinds = _kinds(data.get("pre_tokenizer")) | _kinds(data.get("decoder"))
        byte_level = "ByteLevel" in kinds
        byte_fallback = bool(data["model"].get("byte_fallback")) or "ByteFallback" in kinds
        n = self._tok.get_vocab_size(with_added_tokens=True)
        if n > MAX_TOKEN_ID:
            raise TokenizerError(f"{path} has {n} tokens; at most {MAX_TOKEN_ID} are supported")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not 1 <= vocab_size <= MAX_TOKEN_ID):  # fmt: skip
            raise TokenizerError(f"vocab_size must be an int in 1..{MAX_TOKEN_ID}, got {vocab_size!r:.40}")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        size = max([*vocab.values(), (vocab_size or 0) - 1]) + 1
        decoder = self._tok.get_added_tokens_decoder()
        added = {t.content: i for i, t in decoder.items()}
        table = byte_level_table()
        self._vocab = [b""] * size
        for piece, i in vocab.items():
            if piece in added:
                self._vocab[i] = piece.encode()
            else:
                self._vocab[i] = token_bytes_of(piece, byte_level, byte_fallback, table)
        # the tokens `skip_special_tokens` hides: the added tokens marked special
        self.special_tokens = {t.content: i for i, t in decoder.items() if t.special}
        self.path = path
        if eos_token is not None and eos_token not in vocab:
            raise TokenizerError(f"{path}: the eos token {eos_token!r:.60} is not in the vocabulary")
        self._eos = vocab[eos_token] if eos_token is not None else None
        # Llama-2-style decoders end with Strip(" ", start=1): decode drops that leading space
        self._strip = sum(
            int(d.get("start", 0)) for d in _nodes(data.get("decoder"), "Strip") if d.get("content") == " "
        )

    @property
    def eos_token_id(self) -> int:
        if self._eos is None:
            raise TokenizerError(f"{self.path}: tokenizer_config.json names no eos_token")
        return self._eos

    @property
    def dummy_token_indices(self) -> tuple[int, ...]:
        return ()

    def decode(self, ids: list[int]) -> str:
        """The tokens' bytes as UTF-8, less the leading spaces a `Strip` decoder removes."""
        text = super().decode(ids)
        n = len(text) - len(text.lstrip(" "))
        return text[min(n, self._strip) :]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        _check_text(text)
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works, so a
        # long text tokenized in a worker thread (the server's) does not stall the other threads
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def load_hf_tokenizer(folder: str | Path, vocab_size: int | None = None) -> HFTokenizer:
    """The `tokenizer.json` of a checkpoint folder (never a link leading out of it); the EOS is
    `tokenizer_config.json`'s `eos_token` when the folder has one."""
    folder = Path(folder)
    file = contained_file(folder, "tokenizer.json", f"tokenizer folder {folder} has", TokenizerError)
    eos = None
    if (folder / "tokenizer_config.json").exists():
        config = contained_file(
            folder, "tokenizer_config.json", f"tokenizer folder {folder} has", TokenizerError
        )
        data = jsonio.read_json_file(config, TokenizerError)
        value = data.get("eos_token") if isinstance(data, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise TokenizerError(
                f"{config}: eos_token must be a string or {{'content': string}}, got {value!r:.60}"
            )
        eos = value
    return HFTokenizer(file, eos, vocab_size)
