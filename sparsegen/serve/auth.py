"""ASGI middleware that asks for `Authorization: Bearer KEY` when the server has an API key.

Every route but `/health` and `/metrics` (what load balancers and Prometheus scrape) needs the
key; a request without it, or with another, gets 401 with OpenAI's error JSON before its body is
read. Keys are compared in constant time (`hmac.compare_digest`), as bytes.
"""

from __future__ import annotations

import hmac
import json

OPEN_ROUTES = frozenset({"/health", "/metrics"})


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's one `Authorization: Bearer TOKEN` header; None if absent or other."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class RequireApiKey:
    """Plain ASGI middleware (so that client disconnects still reach the handlers)."""

    def __init__(self, app, api_key: str):
        if not api_key or api_key != api_key.strip():
            raise ValueError("the API key must be non-empty, without surrounding whitespace")
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        token = bearer(scope.get("headers", []))
        if token is not None and hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        body = {
            "error": {
                "message": "this server needs an API key: send the header 'Authorization: Bearer KEY'",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
