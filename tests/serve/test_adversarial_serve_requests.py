"""The server against requests an attacker would send: values the batched step cannot hold, and
one bad request among good ones. Each bad one is a 400 naming its field (never a 500), the good
ones beside it succeed, and the server stays healthy with every KV page free."""

from __future__ import annotations

import pytest
from helpers import extras

httpx = extras.require("httpx")
extras.require("fastapi")
from helpers.serve import CHAT, MODEL, OK, all_pages_free  # noqa: E402

from sparsegen.request.sampling_params import MAX_TOKEN_COUNT  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
M = MODEL


@pytest.fixture(autouse=True)
def _every_page_back(server):
    yield
    assert all_pages_free(server) and server.app.state.engine.inflight == 0
    assert server.app.state.engine.alive


def _refused(r, param: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].split("[")[0] == param, err


BEYOND = [
    ("top_k", 2**70),
    ("top_k", MAX_TOKEN_COUNT + 1),
    ("max_tokens", 2**40),
    ("min_tokens", 2**40),
    ("temperature", 1e39),
    ("repetition_penalty", 1e7),
    ("stop_token_ids", [2**40]),
    ("seed", 2**70),
]


@pytest.mark.parametrize("field,value", BEYOND, ids=[f"{f}={v!r:.20}" for f, v in BEYOND])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_value_beyond_the_step_is_a_400_naming_it(http, route, field, value):
    body = {**(OK if route == "/v1/completions" else CHAT), field: value}
    _refused(http.post(route, json=body), field)
