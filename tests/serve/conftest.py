"""Fixtures of the server suites: a served tiny random model (one per module) and a client of it."""

from __future__ import annotations

import pytest
from helpers import extras


@pytest.fixture(scope="module")
def server(single_thread):
    """`sparsegen serve --strict` of random-tiny on loopback, in a thread; up to 4 sequences, 8
    queued (strict: the adversarial suites expect unknown fields to be 400s naming them)."""
    extras.require("fastapi")
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    with ServerThread(LLM(random="tiny", max_num_seqs=4), max_queue=8, strict=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    httpx = extras.require("httpx")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
