"""Serving: `sparsegen.LLM`'s output objects and chat templates, and the OpenAI-compatible
HTTP server (`sparsegen serve`). The HTTP parts (FastAPI, uvicorn, prometheus-client) come
with the `[serve]` extra and are imported only by the server's modules (`app`, `delivery`,
`openai_errors`, `request_counter`, `metrics`, `server`), never by this package."""

from .chat import PHI3SMALL_CHAT_TEMPLATE, ChatTemplate
from .outputs import CompletionOutput, CompletionTracker, RequestOutput

__all__ = [
    "PHI3SMALL_CHAT_TEMPLATE",
    "ChatTemplate",
    "CompletionOutput",
    "CompletionTracker",
    "RequestOutput",
]
