"""Serving: `sparsegen.LLM`'s output objects and chat templates, and the OpenAI-compatible
HTTP server (`sparsegen serve`). The HTTP parts (FastAPI, uvicorn, prometheus-client) come
with the `[serve]` extra and are imported only by `app`, `metrics` and `server`."""

from .chat import PHI3SMALL_CHAT_TEMPLATE, ChatTemplate
from .outputs import CompletionOutput, CompletionTracker, RequestOutput

__all__ = [
    "PHI3SMALL_CHAT_TEMPLATE",
    "ChatTemplate",
    "CompletionOutput",
    "CompletionTracker",
    "RequestOutput",
]
