"""Tokenizers whose vocabulary is bytes, consistently.

- `TiktokenTokenizer`: Phi-3-Small's cl100k-style BPE, read from a local `.tiktoken` file (one
  `base64(token) rank` per line) or a checkpoint folder holding one, plus special tokens.
  Nothing is downloaded: tiktoken only gets the ranks we parsed.
- `ByteTokenizer`: ids 0..255 are the bytes themselves; used by `--random tiny`.

`vocab()` returns `list[bytes]` indexed by token id, special tokens included as their UTF-8
text, so it sorts (mixing `str` and `bytes` in a vocabulary crashes consumers that sort it).
"""

from __future__ import annotations

import base64
import codecs
import json
import re
from pathlib import Path

from .errors import MissingExtraError, TokenizerError

# GPT-4's cl100k pre-tokenisation pattern.
CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
CL100K_NUM_RANKS = 100256


def _phi3small_special_tokens() -> dict[str, int]:
    """Phi-3-Small's ids above the 100256 cl100k ranks; unused ids are `<|dummy_id_N|>`."""
    named = {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|system|>": 100261,
        "<|user|>": 100262,
        "<|assistant|>": 100263,
        "<|end|>": 100266,
        "<|endofprompt|>": 100276,
    }
    unused = [100264, 100265, 100256, *range(100267, 100276), *range(100277, 100352)]
    return {**named, **{f"<|dummy_id_{n}|>": i for n, i in enumerate(unused)}}


PHI3SMALL_SPECIAL_TOKENS = _phi3small_special_tokens()
# Special tokens Phi-3-Small never produces; with the dummies they are masked out of the logits.
UNUSED_SPECIAL_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endofprompt|>")


class _BytesVocabTokenizer:
    """Shared decoding over a bytes vocabulary: `_vocab[i]` is token i's bytes."""

    _vocab: list[bytes]
    special_tokens: dict[str, int]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eos_token_id(self) -> int:
        return self.special_tokens["<|endoftext|>"]

    def vocab(self) -> list[bytes]:
        return list(self._vocab)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._vocab):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary 0..{len(self._vocab) - 1}")
        return self._vocab[token_id]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A function id -> the new text it completes (multi-byte characters wait for their end)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda token_id: decoder.decode(self.token_bytes(token_id))

    @property
    def dummy_token_indices(self) -> tuple[int, ...]:
        unused = set(UNUSED_SPECIAL_TOKENS)
        return tuple(sorted(i for s, i in self.special_tokens.items() if "dummy_id" in s or s in unused))


class ByteTokenizer(_BytesVocabTokenizer):
    """ids 0..255 are bytes; then the given special tokens; the rest up to vocab_size are dummies."""

    def __init__(self, special_tokens: dict[str, int], vocab_size: int):
        specials = dict(special_tokens)
        taken = set(specials.values())
        for i in range(256, vocab_size):
            if i not in taken:
                specials[f"<|dummy_id_{i}|>"] = i
        self.special_tokens = specials
        self._vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        for text, i in specials.items():
            if not 256 <= i < vocab_size:
                raise TokenizerError(f"special token {text!r} has id {i}, outside 256..{vocab_size - 1}")
            self._vocab[i] = text.encode()
        named = sorted((s for s in specials if "dummy_id" not in s), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, named)) + ")")  # dummies never come from text

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_tokens:
                ids.append(self.special_tokens[part])
            else:
                ids += part.encode()
        return ids


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a `.tiktoken` file: lines of `base64(token) rank`."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{path}:{n} is not 'base64-token rank': {line[:60]!r}") from None
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    return ranks


class TiktokenTokenizer(_BytesVocabTokenizer):
    def __init__(
        self, ranks: dict[bytes, int], special_tokens: dict[str, int], vocab_size: int | None = None
    ):
        try:
            import tiktoken
        except ImportError as exc:
            raise MissingExtraError(
                f"reading a .tiktoken vocabulary needs tiktoken ({exc}): pip install 'sparsegen[model]'"
            ) from None

        self.special_tokens = dict(special_tokens)
        size = max([*ranks.values(), *special_tokens.values()]) + 1
        size = max(size, vocab_size or 0)
        self._vocab = [b""] * size
        for token, rank in ranks.items():
            self._vocab[rank] = token
        for text, i in special_tokens.items():
            if i in ranks.values():
                raise TokenizerError(f"special token {text!r} reuses id {i} of an ordinary token")
            self._vocab[i] = text.encode()
        self._enc = tiktoken.Encoding(
            name="sparsegen-bpe",
            pat_str=CL100K_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")


def _special_tokens_for(folder: Path, num_ranks: int) -> dict[str, int]:
    """Phi-3-Small's table for a full cl100k file (else names placed right after the ranks),
    overridden by a tokenizer_config.json `added_tokens_decoder` when the folder has one."""
    if num_ranks == CL100K_NUM_RANKS:
        specials = dict(PHI3SMALL_SPECIAL_TOKENS)
    else:
        names = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
        specials = {s: num_ranks + i for i, s in enumerate(names)}
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return specials
    try:
        added = json.loads(config.read_text()).get("added_tokens_decoder") or {}
        added = {v["content"]: int(k) for k, v in added.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TokenizerError(f"cannot read added_tokens_decoder from {config}: {exc}") from None
    if not added:
        return specials
    if num_ranks != CL100K_NUM_RANKS:
        return added
    taken = set(added.values())
    return {**{s: i for s, i in specials.items() if i not in taken}, **added}


def find_tiktoken_file(path: str | Path) -> Path | None:
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob("*.tiktoken")) if path.is_dir() else []
    return found[0] if found else None


def load_tokenizer(path: str | Path, vocab_size: int | None = None) -> TiktokenTokenizer:
    """From a `.tiktoken` file or a folder holding one (special tokens from tokenizer_config.json,
    else Phi-3-Small's table for a full cl100k file, else placed right after the ranks)."""
    file = find_tiktoken_file(path)
    if file is None:
        raise TokenizerError(f"no .tiktoken file at {path}")
    ranks = read_tiktoken_ranks(file)
    specials = _special_tokens_for(file.parent, len(ranks))
    if "<|endoftext|>" not in specials:
        raise TokenizerError(f"the special tokens for {file} lack <|endoftext|>")
    return TiktokenTokenizer(ranks, specials, vocab_size)
