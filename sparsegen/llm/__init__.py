"""The offline API: `sparsegen.LLM` (prompts or chats in, `RequestOutput`s out) over the engine,
with the checkpoint's chat template and turn-ending tokens (`llm.chat`, `llm.requests`) and what
it is built from (`llm.build`)."""

from .api import LLM

__all__ = ["LLM"]
