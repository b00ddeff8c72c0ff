"""Sending one request's result: whole when it is done, or as server-sent events while it runs.

Either way the request is cancelled when the client goes away, so the engine frees its pages at
once (`AsyncEngine.cancel` is a no-op for a finished request).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import SparsegenError
from .loop import AsyncEngine, RequestStream
from .openai_errors import error_json
from .responses import Formatter


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _drain(stream: RequestStream) -> None:
    while await stream.queue.get() is not None:
        pass


async def whole(engine: AsyncEngine, stream: RequestStream, fmt: Formatter, request: Request):
    """Wait for the whole result, or for the client to leave (then cancel the request)."""
    done = asyncio.ensure_future(_drain(stream))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            return Response(status_code=499)  # nobody reads it; the finally cancels the request
        if stream.error is not None:
            exc = stream.error
            bad_input = isinstance(exc, SparsegenError) and isinstance(exc, ValueError)  # cli.is_usage_error
            status = 400 if bad_input else 500  # a runtime failure (a lost rank, a kernel error): 500
            return error_json(status, f"generation failed: {type(exc).__name__}: {exc}")
        return JSONResponse(fmt.whole())
    finally:
        done.cancel()
        gone.cancel()
        engine.cancel(stream)


def sse(
    engine: AsyncEngine, stream: RequestStream, fmt: Formatter, include_usage: bool, every_chunk: bool = False
) -> StreamingResponse:
    """Server-sent events; `every_chunk` (vLLM's continuous_usage_stats) puts the usage so far on
    each content chunk as well as on the last one."""

    async def events():
        try:
            if fmt.chat:
                for t in stream.trackers:
                    yield fmt.chunk(
                        [
                            {
                                "index": t.index,
                                "delta": {"role": "assistant", "content": fmt.chat_echo},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
            async for u in stream.updates():
                quiet = not u.text and not u.logprobs and not fmt.token_ids and not fmt.pending_echo(u.index)
                if quiet and u.finish_reason is None:
                    continue
                yield fmt.chunk([fmt.delta(u)], usage=fmt.usage() if every_chunk else None)
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
