"""The offline API: `sparsegen.LLM` (prompts or chats in, `RequestOutput`s out) over the engine,
with the checkpoint's chat template and turn-ending tokens (`llm.chat`)."""

from .api import LLM, build_tokenizer

__all__ = ["LLM", "build_tokenizer"]
