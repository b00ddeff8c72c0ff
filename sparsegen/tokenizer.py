"""Tokenizers whose vocabulary is bytes, consistently.

- `TiktokenTokenizer`: Phi-3-Small's cl100k-style BPE, read from a local `.tiktoken` file (one
  `base64(token) rank` per line) or a checkpoint folder holding one, plus special tokens. The
  file is read by tiktoken's own `load_tiktoken_bpe`, with its SHA-256 check (the published hash
  for cl100k_base.tiktoken). Nothing is downloaded. tiktoken is the `[model]` extra, imported on
  first use (`MissingExtraError` naming the extra when it is absent).
- `ByteTokenizer`: ids 0..255 are the bytes themselves; used by `--random tiny`.

`vocab()` returns `list[bytes]` indexed by token id, special tokens included as their UTF-8
text, so it sorts (mixing `str` and `bytes` in a vocabulary crashes consumers that sort it).
"""

from __future__ import annotations

import codecs
import hashlib
import re
from pathlib import Path

from . import jsonio
from .errors import MissingExtraError, TokenizerError
from .folders import contained_file
from .utf8 import check_utf8

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


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise TokenizerError(f"encode takes a str, got {type(text).__name__}: {text!r:.40}")
    check_utf8(text, "the text to encode", TokenizerError)


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
        if isinstance(token_id, bool) or not isinstance(token_id, int):  # True is not token 1
            raise TokenizerError(
                f"a token id must be an int, got {type(token_id).__name__}: {token_id!r:.40}"
            )
        if not 0 <= token_id < len(self._vocab):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary 0..{len(self._vocab) - 1}")
        return self._vocab[token_id]

    def decode(self, ids: list[int]) -> str:
        if not isinstance(ids, (list, tuple)):
            raise TokenizerError(f"decode takes a list of token ids, got {type(ids).__name__}: {ids!r:.40}")
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens` is vLLM's switch; this tokenizer has no BOS to add, so it adds nothing."""
        _check_text(text)
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_tokens:
                ids.append(self.special_tokens[part])
            else:
                ids += part.encode()
        return ids


# SHA-256 of the published files, as tiktoken_ext.openai_public checks them on download; Phi-3-Small
# ships OpenAI's cl100k_base.tiktoken unchanged.
KNOWN_TIKTOKEN_HASHES = {
    "cl100k_base.tiktoken": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
}
MAX_TIKTOKEN_BYTES = 64 << 20  # cl100k is 1.7 MB, o200k 3.6 MB
MAX_TOKEN_ID = 2**24  # the largest id a vocabulary (ranks or special tokens) may use


def _tiktoken():
    """The tiktoken module (with `tiktoken.load`), imported on first use: it is the [model] extra."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as exc:
        raise MissingExtraError(
            f"reading a .tiktoken vocabulary needs tiktoken ({exc}): pip install 'sparsegen[model]'"
        ) from None
    return tiktoken


def read_tiktoken_ranks(path: str | Path, expected_hash: str | None = None) -> dict[bytes, int]:
    """Parse a `.tiktoken` file (lines of `base64(token) rank`) with tiktoken's `load_tiktoken_bpe`.

    The file's SHA-256 must equal `expected_hash`, or by default the published hash of a file of
    that name (`KNOWN_TIKTOKEN_HASHES`: cl100k_base.tiktoken). The ranks must be 0..n-1, each once.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_TIKTOKEN_BYTES:
            raise TokenizerError(
                f"{path} is {size} bytes; a .tiktoken file of at most {MAX_TIKTOKEN_BYTES} is expected"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    want = expected_hash if expected_hash is not None else KNOWN_TIKTOKEN_HASHES.get(path.name)
    if want is not None and digest != want:
        raise TokenizerError(
            f"{path} has SHA-256 {digest}, expected {want}: the file is corrupt or not the published {path.name}"
        )
    tiktoken = _tiktoken()
    try:
        # tiktoken caches what it reads under a key made from the path (TIKTOKEN_CACHE_DIR, else a
        # shared temp folder) and, given no hash, would hand back that cached copy even after the
        # file changed, or one planted by someone else. With the digest of the bytes just read it
        # returns exactly those bytes, parsed.
        ranks = tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=digest)
    except ValueError as exc:  # a line that is not `base64 rank` (or the file changed meanwhile)
        raise TokenizerError(f"{path} is not a .tiktoken file: {exc}") from None
    except OSError as exc:  # e.g. an unwritable TIKTOKEN_CACHE_DIR
        raise TokenizerError(f"cannot read {path} through tiktoken: {exc}") from None
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    lines = sum(1 for line in data.splitlines() if line)
    if len(ranks) != lines or set(ranks.values()) != set(range(len(ranks))):
        raise TokenizerError(
            f"{path} has {lines} lines but {len(ranks)} distinct tokens with ranks "
            f"{min(ranks.values())}..{max(ranks.values())}; each token must appear once, ranked 0..n-1"
        )
    return ranks


class TiktokenTokenizer(_BytesVocabTokenizer):
    def __init__(
        self, ranks: dict[bytes, int], special_tokens: dict[str, int], vocab_size: int | None = None
    ):
        tiktoken = _tiktoken()
        for text, i in special_tokens.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_TOKEN_ID:
                raise TokenizerError(
                    f"special token {text!r:.60} has id {i!r:.40}, outside 0..{MAX_TOKEN_ID - 1}"
                )
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not 1 <= vocab_size <= MAX_TOKEN_ID):  # fmt: skip
            raise TokenizerError(f"vocab_size must be an int in 1..{MAX_TOKEN_ID}, got {vocab_size!r:.40}")
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens` is vLLM's switch; Phi-3-Small's tokenizer adds no BOS or EOS to a
        text (its transformers class returns the ids as they are), so it adds nothing here either."""
        _check_text(text)
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
    config = contained_file(folder, config.name, f"tokenizer folder {folder} has", TokenizerError)
    data = jsonio.read_json_file(config, TokenizerError)
    added = data.get("added_tokens_decoder") if isinstance(data, dict) else None
    if added is not None and not isinstance(added, dict):
        raise TokenizerError(
            f"{config}: added_tokens_decoder must be an object of id -> token, got {added!r:.60}"
        )
    out: dict[str, int] = {}
    for key, value in (added or {}).items():
        content = value.get("content") if isinstance(value, dict) else None
        if not isinstance(content, str) or not key.isdigit() or not 0 <= int(key) < MAX_TOKEN_ID:
            raise TokenizerError(
                f"{config}: added_tokens_decoder[{key!r:.20}] must map an id in 0..{MAX_TOKEN_ID - 1} "
                f"to {{'content': str}}, got {value!r:.60}"
            )
        out[content] = int(key)
    added = out
    if not added:
        return specials
    if num_ranks != CL100K_NUM_RANKS:
        return added
    taken = set(added.values())
    return {**{s: i for s, i in specials.items() if i not in taken}, **added}


def find_tiktoken_file(path: str | Path) -> Path | None:
    """The file itself, or the first `*.tiktoken` inside a folder (never a link leading out of it)."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob("*.tiktoken")) if path.is_dir() else []
    if not found:
        return None
    return contained_file(path, found[0].name, f"tokenizer folder {path} has", TokenizerError)


def load_tokenizer(
    path: str | Path, vocab_size: int | None = None, *, expected_hash: str | None = None
) -> TiktokenTokenizer:
    """From a `.tiktoken` file or a folder holding one (special tokens from tokenizer_config.json,
    else Phi-3-Small's table for a full cl100k file, else placed right after the ranks).
    `expected_hash`: the file's SHA-256 (default: the published one for a known file name)."""
    if not isinstance(path, (str, Path)):
        raise TokenizerError(
            f"a tokenizer path must be a str or Path, got {type(path).__name__} {path!r:.40}"
        )
    file = find_tiktoken_file(path)
    if file is None:
        raise TokenizerError(f"no .tiktoken file at {path}")
    ranks = read_tiktoken_ranks(file, expected_hash)
    specials = _special_tokens_for(file.parent, len(ranks))
    if "<|endoftext|>" not in specials:
        raise TokenizerError(f"the special tokens for {file} lack <|endoftext|>")
    return TiktokenTokenizer(ranks, specials, vocab_size)
