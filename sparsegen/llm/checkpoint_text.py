"""What a checkpoint folder says about text: its tokenizer, chat template and end-of-turn ids.

`load_checkpoint_text(folder)` is the one entry point the model families and `LLM` call:
- the tokenizer: `tokenizer.json` (the `tokenizers` library) when the folder has one, else a
  `*.tiktoken` file, else None (the checkpoint takes token ids only);
- the chat template (`chat.ChatTemplate.from_folder`: `chat_template.jinja`, else
  `tokenizer_config.json`'s `chat_template`, else Phi-3-Small's turn format);
- the EOS ids: `generation_config.json`'s `eos_token_id` (an int or a list), else
  `config.json`'s (transformers' `generate` takes them so), else the tokenizer's `eos_token`.
  Every one of them stops generation.
Every file is read inside the folder only (`folders.contained_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import TokenizerError
from ..tokenizer import find_tiktoken_file, load_tokenizer
from .chat import ChatTemplate, config_eos_token_ids, eos_token_ids
from .hf_tokenizer import load_hf_tokenizer


@dataclass(frozen=True)
class CheckpointText:
    tokenizer: object | None  # HFTokenizer, TiktokenTokenizer, or None
    chat_template: ChatTemplate
    eos_token_ids: tuple[int, ...]


def load_folder_tokenizer(folder: str | Path, vocab_size: int | None = None):
    """The folder's tokenizer: tokenizer.json first, else a .tiktoken file, else None."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"{folder} is not a checkpoint folder")
    if (folder / "tokenizer.json").exists() or (folder / "tokenizer.json").is_symlink():
        return load_hf_tokenizer(folder, vocab_size)
    if find_tiktoken_file(folder) is not None:
        return load_tokenizer(folder, vocab_size)
    return None


def load_checkpoint_text(folder: str | Path, vocab_size: int) -> CheckpointText:
    """The folder's tokenizer, chat template and EOS ids (see the module docstring).
    `vocab_size`: the model's (its embedding rows); every EOS id must be below it."""
    folder = Path(folder)
    tokenizer = load_folder_tokenizer(folder, vocab_size)
    template = ChatTemplate.from_folder(folder)
    ids = list(eos_token_ids(folder, vocab_size) or config_eos_token_ids(folder, vocab_size))
    if not ids and tokenizer is not None:
        try:
            ids.append(tokenizer.eos_token_id)
        except (TokenizerError, KeyError):  # a tokenizer that names no EOS
            pass
    return CheckpointText(tokenizer, template, tuple(dict.fromkeys(ids)))
