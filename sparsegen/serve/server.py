"""Run the app under uvicorn: in the foreground (`sparsegen serve`) or in a thread (tests, notebooks).

It binds to 127.0.0.1 unless told otherwise; a server reachable from other machines without an
API key is announced with a warning. Shutdown on SIGTERM or SIGINT: uvicorn stops
accepting connections, lets the requests in flight finish for up to `drain_timeout` seconds
(then cancels them), and runs the app's shutdown, which stops the engine thread. `serve()` then
returns normally, so the process exits 0. (uvicorn re-raises the signal it caught once it is
done; the handler installed here for that moment only logs it.)
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import threading
import time

import uvicorn

from ..llm import LLM
from .app import create_app

log = logging.getLogger("sparsegen")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def loopback(sock: socket.socket) -> bool:
    """Does the bound socket serve this machine only (127.0.0.0/8 or ::1)?"""
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def _server(
    llm: LLM, max_queue: int, drain_timeout: float, model_name: str | None, **app_options
) -> uvicorn.Server:
    app = create_app(llm, max_queue=max_queue, model_name=model_name, **app_options)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=drain_timeout,
        lifespan="on",
        log_config=None,
    )
    return uvicorn.Server(config)


def serve(
    llm: LLM,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_queue: int = 256,
    drain_timeout: float = 30.0,
    model_name: str | None = None,
    api_key: str | None = None,
    strict: bool = False,
) -> None:
    """Serve until SIGTERM/SIGINT; returns after a drained shutdown."""
    server = _server(llm, max_queue, drain_timeout, model_name, api_key=api_key, strict=strict)
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    log.info(
        "serving %s on http://%s:%d (max queue %d)", model_name or llm.model_name, host, actual, max_queue
    )
    if not loopback(sock) and api_key is None:
        log.warning(
            "%s is reachable from other machines, and this server asks for no API key: anyone who can "
            "reach it can use it (the default --host 127.0.0.1 serves this machine only)", host
        )  # fmt: skip

    def after_shutdown(sig, frame):
        log.info("stopped on %s", signal.Signals(sig).name)

    previous = {s: signal.signal(s, after_shutdown) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()


class ServerThread:
    """`with ServerThread(llm) as srv: ... srv.url ...`: the server on an ephemeral port of
    127.0.0.1, in a daemon thread; leaving the block shuts it down (draining for `drain_timeout`)."""

    def __init__(
        self,
        llm: LLM,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_queue: int = 256,
        drain_timeout: float = 5.0,
        model_name: str | None = None,
        api_key: str | None = None,
        strict: bool = False,
    ):
        self.server = _server(llm, max_queue, drain_timeout, model_name, api_key=api_key, strict=strict)
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def app(self):
        return self.server.config.app

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.sock.close()
