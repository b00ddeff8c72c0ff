"""The OpenAI-compatible HTTP API over one `LLM`, as a FastAPI app.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with stream: true)
    POST /tokenize, /detokenize                  (vLLM's shapes: `tokenize.py`)
    GET  /v1/models, /health, /metrics

With an API key, every route but /health and /metrics answers 401 unless the request carries
`Authorization: Bearer KEY` (`auth.py`). Unknown body fields are dropped and logged once per
name, or refused with a 400 naming them when `strict` (`unknown_fields.py`).

Every refusal is OpenAI's error JSON (`openai_errors.py`): 400 for a body that does not parse or
validate (the message and `param` name the field), a prompt over the context limit or an
unknown model; 413 for a body over `MAX_BODY_BYTES`; 415 for a body that is not sent as
`application/json` (a web page may send text/plain, forms or multipart to any local server
without asking: the CORS "simple requests"; JSON needs a preflight this server never answers); 503 when the queue is full or the server
is shutting down; 404/405 for unknown routes and methods. Responses are built in
`responses.py` and sent whole or streamed by `delivery.py`; a client that disconnects cancels
its request, and the engine frees its pages at once; one that leaves before sending its whole
body is not an error (nothing is logged above debug).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import RequestError, ServerOverloaded, SparsegenError
from ..llm import LLM
from .auth import RequireApiKey
from .delivery import sse, whole
from .loop import AsyncEngine
from .metrics import Metrics
from .openai_errors import error_json, sampling_error, validation_error
from .protocol import ChatCompletionRequest, CompletionRequest
from .request_counter import CountRequests
from .response_format import constraint_field
from .responses import Echo, Formatter
from .tokenize import add_tokenize_routes
from .unknown_fields import UnknownFields

MAX_BODY_BYTES = 8 << 20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(
    llm: LLM,
    *,
    max_queue: int = 256,
    model_name: str | None = None,
    api_key: str | None = None,
    strict: bool = False,
) -> FastAPI:
    name = model_name or llm.model_name
    metrics = Metrics(name)
    fields = UnknownFields(strict)
    engine = AsyncEngine(llm, max_queue=max_queue, metrics=metrics)
    metrics.bind(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="sparsegen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llm, app.state.engine, app.state.metrics = llm, engine, metrics

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_json(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _request_error(request: Request, exc: RequestValidationError):
        return error_json(400, str(exc))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):  # left mid-body: nobody to answer
        logging.getLogger("sparsegen").debug(
            "client left before sending its whole body: %s", request.url.path
        )
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):  # never a bare 500 page
        logging.getLogger("sparsegen").error("unhandled error in %s", request.url.path, exc_info=exc)
        return error_json(500, "internal server error")

    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(CountRequests, metrics=metrics)  # added last: outermost, so 401s are counted

    async def parse(request: Request, model: type[BaseModel], any_model: bool = False):
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":  # text/plain, forms and multipart are what any web page may send
            raise RequestError(
                f"the body must be sent as application/json, not {media or 'without a content-type'!r:.80}",
                "content-type",
                "unsupported_media_type",
                status=415,
            )
        chunks, size = [], 0
        async for chunk in request.stream():  # read at most MAX_BODY_BYTES, whatever the client sends
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError(f"the body is over {MAX_BODY_BYTES} bytes", "body", status=413)
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            req = fields.validate(model, body)
            req.check()
        except ValidationError as exc:
            raise validation_error(exc, body) from None
        if req.model != name and not (any_model and req.model is None):
            raise RequestError(
                f"the model {req.model!r} is not served here; it is {name!r}", "model", "model_not_found"
            )
        return req

    def fit(prompt_ids: list[list[int]], max_tokens: int | None, default: int | None, where: str) -> int:
        """The request's max_tokens, checked against the context limit and the KV cache."""
        limit = llm.max_model_len
        _, room = llm.engine.kv_capacity  # tokens the KV cache holds for sequences (whole pages)
        longest = max(len(p) for p in prompt_ids)
        if max_tokens is None:
            max_tokens = default if default is not None else min(limit, room) - longest
            max_tokens = max(1, min(max_tokens, min(limit, room) - longest))
        if longest + max_tokens > limit:
            raise RequestError(
                f"this model's context is {limit} tokens; the {where} has {longest} and max_tokens asks for "
                f"{max_tokens} more",
                "max_tokens",
                "context_length_exceeded",
            )
        if longest + max_tokens > room:
            raise RequestError(
                f"{longest} + {max_tokens} tokens do not fit in the KV cache ({room} tokens)",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens

    def params_of(req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
        try:
            params = req.sampling_params(max_tokens, logprobs)
            if prompt_logprobs is not None:
                params = replace(params, prompt_logprobs=prompt_logprobs)
            return llm.check_params(params, "request")
        except RequestError:
            raise
        except SparsegenError as exc:  # SamplingParams' own checks name the field in the message
            if str(exc).startswith("structured_outputs"):  # the grammar does not compile
                raise RequestError(str(exc), constraint_field(req)) from None
            raise sampling_error(exc) from None

    def prompt_ids(make, param: str) -> list[list[int]]:
        try:
            return make()
        except SparsegenError as exc:  # not text, out of the vocabulary, or over the context
            raise RequestError(
                str(exc), param, "context_length_exceeded" if "at most" in str(exc) else None
            ) from None

    def echo_of(req: CompletionRequest, ids: list[list[int]], n: int) -> Echo:
        """Each choice's prompt text: as sent, or decoded from the token ids sent."""
        tok = llm.tokenizer
        texts = [p if isinstance(p, str) else tok.decode(x) if tok is not None else ""
                 for p, x in zip(req.prompts(), ids, strict=True)]  # fmt: skip
        return Echo(tuple(t for t in texts for _ in range(n)), req.echo_only)

    async def respond(request: Request, model: type[BaseModel], chat: bool):
        try:
            req = await parse(request, model)
            # Rendering and tokenizing run in a worker thread (the tokenizer lets go of the GIL),
            # so one long prompt does not hold up the event loop and every other request with it.
            if chat:
                ids = await run_in_threadpool(
                    prompt_ids,
                    lambda: [
                        llm.render_chat(req.conversation(), req.add_generation_prompt, req.add_special_tokens)
                    ],
                    "messages",
                )
                max_tokens = fit(ids, req.requested_max_tokens, None, "conversation")
                params = params_of(req, max_tokens, req.logprobs_k, req.prompt_logprobs)
            else:
                ids = await run_in_threadpool(
                    prompt_ids,
                    lambda: [llm.encode(p, "prompt", req.add_special_tokens) for p in req.prompts()],
                    "prompt",
                )
                asked = 1 if req.echo_only else req.max_tokens  # echo only: one token run, not returned
                max_tokens = fit(ids, asked, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
                scored = [
                    k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None
                ]
                params = params_of(req, max_tokens, req.logprobs, max(scored) if scored else None)
            stream = engine.submit(ids, params, "chatcmpl" if chat else "cmpl")
        except RequestError as exc:
            return error_json(exc.status, str(exc), exc.param, exc.code)
        except ServerOverloaded as exc:
            return error_json(503, str(exc), None, "overloaded")
        echo = None if chat or not req.echo else echo_of(req, ids, params.n)
        fmt = Formatter(
            llm, stream, name, chat=chat, token_ids=req.return_token_ids, echo=echo,
            prompt_logprobs=req.prompt_logprobs, chat_echo=req.echo_text() if chat else "",
        )  # fmt: skip
        if req.stream:
            opts = req.stream_options
            include_usage = bool(opts and opts.include_usage)
            return sse(engine, stream, fmt, include_usage, include_usage and opts.continuous_usage_stats)
        return await whole(engine, stream, fmt, request)

    # -- routes ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.alive or not engine.accepting:
            return error_json(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "sparsegen"}
        card["max_model_len"] = llm.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await respond(request, ChatCompletionRequest, chat=True)

    add_tokenize_routes(app, llm, parse, prompt_ids)
    return app
