"""Checks shared by the server tests: every KV page back and the engine idle after a request."""

from __future__ import annotations

import time

# the smallest well-formed bodies for the served random-tiny model (tests/serve/conftest.py)
MODEL = "random-tiny"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def all_pages_free(server, timeout: float = 10.0) -> bool:
    """Within `timeout` seconds, the served engine holds no page and no unfinished request."""
    engine = server.app.state.engine.engine
    alloc = engine.cache.allocator
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alloc.num_free == alloc.capacity and not engine.has_unfinished:
            return True
        time.sleep(0.02)
    return False
