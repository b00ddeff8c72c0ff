"""The OpenAI-compatible HTTP server (`sparsegen serve`) over `sparsegen.LLM`. The HTTP parts
(FastAPI, uvicorn, prometheus-client) come with the `[serve]` extra and are imported only by the
server's modules (`app`, `delivery`, `openai_errors`, `request_counter`, `metrics`, `server`),
never by this package."""
