"""The OpenAI-compatible HTTP API over one `LLM`, as a FastAPI app.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with stream: true)
    GET  /v1/models, /health, /metrics

Every refusal is OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for
a body that does not parse or validate (the message and `param` name the field), a prompt
over the context limit or an unknown model; 413 for a body over `MAX_BODY_BYTES`; 503 when the
queue is full or the server is shutting down; 404/405 for unknown routes and methods.
A client that disconnects cancels its request, and the engine frees its pages at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RequestError, ServerOverloaded, SparsegenError
from ..llm import LLM
from .loop import AsyncEngine, RequestStream, Update
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest

MAX_BODY_BYTES = 8 << 20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def error_json(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _field_names(*models: type[BaseModel]) -> set[str]:
    names, todo = set(), list(models)
    while todo:
        m = todo.pop()
        for name, f in m.model_fields.items():
            names.add(name)
            for arg in getattr(f.annotation, "__args__", ()) or ():
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
                for sub in getattr(arg, "__args__", ()) or ():
                    if isinstance(sub, type) and issubclass(sub, BaseModel):
                        todo.append(sub)
    return names


FIELDS = _field_names(CompletionRequest, ChatCompletionRequest)


def _param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; union-branch tags such as 'list[int]' stop it."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FIELDS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def _validation_error(exc: ValidationError) -> RequestError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first['msg']}", "body", "invalid_json")
    if first["type"] == "model_type":
        return RequestError("the body must be a JSON object", "body")
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        parent = _param(loc[:-1])
        param = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
        return RequestError(f"unknown field {param!r}", param)
    param = _param(loc)
    msg = first["msg"]
    if len(errors) > 1 and all(_param(tuple(e["loc"])) == param for e in errors):
        msg = "; ".join(dict.fromkeys(e["msg"] for e in errors[:4]))
    return RequestError(f"{param or 'body'}: {msg}", param)


_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _CountRequests:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from
    the handlers): counts requests by route and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()


def create_app(llm: LLM, *, max_queue: int = 256, model_name: str | None = None) -> FastAPI:
    metrics = Metrics()
    engine = AsyncEngine(llm, max_queue=max_queue, metrics=metrics)
    metrics.bind(engine)
    name = model_name or llm.model_name
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

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):  # never a bare 500 page
        logging.getLogger("sparsegen").error("unhandled error in %s", request.url.path, exc_info=exc)
        return error_json(500, "internal server error")

    app.add_middleware(_CountRequests, metrics=metrics)

    async def parse(request: Request, model: type[BaseModel]):
        chunks, size = [], 0
        async for chunk in request.stream():  # read at most MAX_BODY_BYTES, whatever the client sends
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError(f"the body is over {MAX_BODY_BYTES} bytes", "body", status=413)
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            req = model.model_validate_json(body)
            req.check()
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if req.model != name:
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

    def params_of(req, max_tokens: int, logprobs: int | None):
        try:
            return llm.check_params(req.sampling_params(max_tokens, logprobs), "request")
        except RequestError:
            raise
        except SparsegenError as exc:  # SamplingParams' own checks name the field in the message
            m = _FIELD_IN_MESSAGE.search(str(exc)) or re.search(r"request\.(\w+)", str(exc))
            raise RequestError(str(exc), m.group(1) if m else None) from None

    def prompt_ids(make, param: str) -> list[list[int]]:
        try:
            return make()
        except SparsegenError as exc:  # not text, out of the vocabulary, or over the context
            raise RequestError(
                str(exc), param, "context_length_exceeded" if "at most" in str(exc) else None
            ) from None

    async def respond(request: Request, model: type[BaseModel], chat: bool):
        try:
            req = await parse(request, model)
            if chat:
                ids = prompt_ids(
                    lambda: [llm.render_chat(req.conversation(), req.add_generation_prompt)], "messages"
                )
                max_tokens = fit(ids, req.requested_max_tokens, None, "conversation")
                params = params_of(req, max_tokens, req.logprobs_k)
            else:
                ids = prompt_ids(lambda: [llm.encode(p, "prompt") for p in req.prompts()], "prompt")
                max_tokens = fit(ids, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
                params = params_of(req, max_tokens, req.logprobs)
            stream = engine.submit(ids, params, "chatcmpl" if chat else "cmpl")
        except RequestError as exc:
            return error_json(exc.status, str(exc), exc.param, exc.code)
        except ServerOverloaded as exc:
            return error_json(503, str(exc), None, "overloaded")
        fmt = _Formatter(llm, stream, name, chat=chat, token_ids=req.return_token_ids)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(engine, stream, fmt, include_usage)
        return await _whole(engine, stream, fmt, request)

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

    return app


# -- responses ---------------------------------------------------------------------------------------
class _Formatter:
    """Builds OpenAI's JSON for one request (whole responses and stream chunks)."""

    def __init__(self, llm: LLM, stream: RequestStream, model: str, chat: bool, token_ids: bool = False):
        self.llm, self.stream, self.model, self.chat, self.token_ids = llm, stream, model, chat, token_ids
        self.id = stream.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offsets = [0] * len(stream.trackers)

    def _bytes(self, token_id: int) -> bytes:
        tok = self.llm.tokenizer
        return tok.token_bytes(token_id) if tok is not None else b""

    def _token(self, token_id: int) -> str:
        """The token's text; a token that is not whole UTF-8 is spelled `bytes:\\xNN...` (as
        OpenAI does), and without a tokenizer `token_id:N`."""
        if self.llm.tokenizer is None:
            return f"token_id:{token_id}"
        raw = self._bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def logprobs(self, index: int, items) -> dict | None:
        if self.stream.trackers[index].params.logprobs is None:
            return None
        if self.chat:
            content = []
            for lp in items:
                content.append(
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._bytes(lp.token_id)),
                        "top_logprobs": [
                            {"token": self._token(i), "logprob": x, "bytes": list(self._bytes(i))}
                            for i, x in lp.top
                        ],
                    }
                )
            return {"content": content}
        tokens = [self._token(lp.token_id) for lp in items]
        offsets = []
        for t in tokens:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token(i): x for i, x in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def usage(self) -> dict:
        p, c = self.stream.prompt_tokens, self.stream.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def whole(self) -> dict:
        choices = []
        for t in self.stream.trackers:
            out = t.output()
            lp = self.logprobs(t.index, out.logprobs or [])
            reason = out.finish_reason
            if self.chat:
                choice = {"index": t.index, "message": {"role": "assistant", "content": out.text}}
            else:
                choice = {
                    "index": t.index,
                    "text": out.text if out.text is not None else "",
                }  # no tokenizer: ids only
            choice.update({"logprobs": lp, "finish_reason": reason, "stop_reason": out.stop_reason})
            if self.token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta(self, u: Update) -> dict:
        lp = self.logprobs(u.index, u.logprobs)
        if self.chat:
            d = {"index": u.index, "delta": {"content": u.text} if u.text else {}}
        else:
            d = {"index": u.index, "text": u.text}
        d.update({"logprobs": lp, "finish_reason": u.finish_reason})
        if self.token_ids:
            d["token_ids"] = list(u.token_ids)
        if u.finish_reason is not None:
            d["stop_reason"] = u.stop_reason
        return d


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _drain(stream: RequestStream) -> None:
    while await stream.queue.get() is not None:
        pass


async def _whole(engine: AsyncEngine, stream: RequestStream, fmt: _Formatter, request: Request):
    """Wait for the whole result, or for the client to leave (then cancel the request)."""
    done = asyncio.ensure_future(_drain(stream))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            return Response(status_code=499)  # nobody reads it; the finally cancels the request
        if stream.error is not None:
            exc = stream.error
            status = 400 if isinstance(exc, SparsegenError) else 500
            return error_json(status, f"generation failed: {type(exc).__name__}: {exc}")
        return JSONResponse(fmt.whole())
    finally:
        done.cancel()
        gone.cancel()
        engine.cancel(stream)


def _sse(
    engine: AsyncEngine, stream: RequestStream, fmt: _Formatter, include_usage: bool
) -> StreamingResponse:
    async def events():
        try:
            if fmt.chat:
                for t in stream.trackers:
                    yield fmt.chunk(
                        [
                            {
                                "index": t.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
            async for u in stream.updates():
                if not u.text and u.finish_reason is None and not u.logprobs and not fmt.token_ids:
                    continue
                yield fmt.chunk([fmt.delta(u)])
            if include_usage:
                yield fmt.chunk([], usage=fmt.usage())
        except Exception as exc:  # the engine failed this request after the headers went out
            err = {
                "error": {
                    "message": f"{type(exc).__name__}: {exc}",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            engine.cancel(stream)  # a no-op once finished; on a disconnect, frees the pages now
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
