"""ASGI middleware that counts requests by route and status code for `/metrics`."""

from __future__ import annotations

from .metrics import Metrics

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)


class CountRequests:
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
