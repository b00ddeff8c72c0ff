"""Clients that go away at every point of a request: mid-body, before the body, while waiting
for a whole answer, mid-stream. None of these is an error the server logs (no "unhandled
error", no traceback), every KV page comes back, and the server goes on serving."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
from helpers import extras

httpx = extras.require("httpx")
extras.require("fastapi")
from helpers.serve import all_pages_free  # noqa: E402

from sparsegen import LLM  # noqa: E402
from sparsegen.serve.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
LONG = {"model": "random-tiny", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "temperature": 1.0}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def loud(self) -> list[str]:
        return [
            f"{r.name}: {r.getMessage()}"
            for r in self.records
            if r.levelno >= logging.WARNING or r.exc_info is not None
        ]


@pytest.fixture(scope="module")
def server(single_thread):  # noqa: F811
    with ServerThread(LLM(random="tiny", max_num_seqs=2), max_queue=4) as srv:
        yield srv


@pytest.fixture
def logs(server):
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("sparsegen", "uvicorn", "uvicorn.error", "")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


def _send_and_leave(server, raw: bytes, wait: float = 0.3) -> None:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(raw)
    time.sleep(wait)
    s.close()


def _head(length: str = "Content-Length: 1000", path: str = "/v1/completions") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode()


def _healthy(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": "random-tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert all_pages_free(server) and server.app.state.engine.inflight == 0


CASES = {
    "mid-body": _head() + b'{"model": "random-tiny", "pro',
    "after the headers": _head(),
    "mid-body, chat": _head(path="/v1/chat/completions") + b'{"messages": [',
    "mid-chunk": _head("Transfer-Encoding: chunked") + b'40\r\n{"model": "random-tiny"',
}


@pytest.mark.parametrize("case", list(CASES))
def test_leaving_before_the_body_is_sent_is_not_an_error(server, logs, case):
    _send_and_leave(server, CASES[case])
    time.sleep(0.5)
    assert logs.loud() == []
    _healthy(server)


def _engine_busy(server, timeout: float = 30) -> bool:
    engine = server.app.state.engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.has_unfinished:
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_leaving_while_generating_frees_every_page_quietly(server, logs, stream):
    body = json.dumps({**LONG, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(_head(f"Content-Length: {len(body)}") + body)
    assert _engine_busy(server)
    if stream:
        assert s.recv(100)  # the stream's first bytes came
    s.close()
    assert all_pages_free(server, timeout=30)  # cancelled: not 400 tokens later
    assert logs.loud() == []
    _healthy(server)
