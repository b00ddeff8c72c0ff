"""The server against bad bodies: every one is a 4xx OpenAI error JSON naming the field, never a 500,
and the server stays healthy with every KV page free afterwards."""

from __future__ import annotations

import json
import random

import pytest
from helpers import extras

httpx = extras.require("httpx")
extras.require("fastapi")
from helpers.serve import CHAT, MODEL, OK, all_pages_free  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
M = MODEL


@pytest.fixture(autouse=True)
def _every_page_back(server):
    """After each bad request (and the good one), no KV page is held and nothing is queued."""
    yield
    assert all_pages_free(server) and server.app.state.engine.inflight == 0


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (body, the param the error must name)
COMPLETION_CASES = [
    (without(OK, "model"), "model"),
    ({**OK, "model": "gpt-4"}, "model"),
    ({**OK, "model": 3}, "model"),
    (without(OK, "prompt"), "prompt"),
    *[
        ({**OK, "prompt": p}, "prompt")
        for p in (
            5,
            None,
            [],
            [[]],
            [1, "a"],
            [-1],
            [True],
            [[1, 2], "x"],
            "",
            [300],
            [2.5],
            {"a": 1},
            "x" * 5000,
        )
    ],
    *[({**OK, "max_tokens": v}, "max_tokens") for v in (0, -1, "5", 1.5, True, 5000, 10**30, [1])],
    *[({**OK, "temperature": v}, "temperature") for v in (-1, "hot", True, [0.5], {"v": 1})],
    *[({**OK, "top_p": v}, "top_p") for v in (0, 1.5, "x", -0.1, False)],
    *[({**OK, "top_k": v}, "top_k") for v in (-2, 1.5, "3", True)],
    *[({**OK, "min_p": v}, "min_p") for v in (2, -0.5, "0.1")],
    *[({**OK, "n": v}, "n") for v in (0, 17, 2.0, "2", True, -3)],
    *[({**OK, "stop": v}, "stop") for v in (5, [1], [""], ["a"] * 17, "x" * 300, [None], {"s": 1})],
    *[({**OK, "seed": v}, "seed") for v in (-1, 2**64, "1", 1.0, True)],
    *[({**OK, "logprobs": v}, "logprobs") for v in (-1, 21, True, "2", 1.5)],
    *[({**OK, "stream": v}, "stream") for v in ("yes", 1, None)],
    ({**OK, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**OK, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({**OK, "stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus"),
    ({**OK, "foo": 1}, "foo"),
    ({**OK, "temprature": 0.5}, "temprature"),
    *[({**OK, "presence_penalty": v}, "presence_penalty") for v in (3, -2.5, "0")],
    *[({**OK, "frequency_penalty": v}, "frequency_penalty") for v in (-3, 2.1)],
    *[({**OK, "repetition_penalty": v}, "repetition_penalty") for v in (0, -1, "1")],
    ({**OK, "min_tokens": 5}, "min_tokens"),
    ({**OK, "min_tokens": -1}, "min_tokens"),
    *[({**OK, "stop_token_ids": v}, "stop_token_ids") for v in ([1, -1], [100000], "abc", [True], [1.0])],
    *[({**OK, "ignore_eos": v}, "ignore_eos") for v in ("true", 1)],
    *[({**OK, "echo": v}, "echo") for v in ("yes", 1, None)],  # echo itself is served (scoring)
    ({**OK, "suffix": "x"}, "suffix"),
    ({**OK, "best_of": 3}, "best_of"),
    *[
        ({**OK, "logit_bias": v}, "logit_bias")
        for v in (
            {"1": 101},
            {"1": -100.5},
            {"x": 1},
            {"-1": 1},
            {"1.0": 1},
            {"99999999999": 1},
            {"1": "5"},
            [1],
            {"100000": 1},
            {str(i): 1 for i in range(1025)},
        )
    ],
    *[({**OK, "allowed_token_ids": v}, "allowed_token_ids") for v in ([], [-1], [1.0], "1", [100000])],
    ({**OK, "user": 5}, "user"),
]
CHAT_CASES = [
    (without(CHAT, "messages"), "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": "x"}, {"role": "user"}]}, "messages[1].content"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages[0].content",
    ),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "json_object", "bogus": 1}}, "response_format"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logprobs": 5}, "logprobs"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({**CHAT, "max_tokens": 4096}, "max_tokens"),
    ({**CHAT, "prompt": "x"}, "prompt"),
]


def check_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param + "["), (err, param)
        assert param.split("[")[0].split(".")[0] in err["message"], err
    return err


@pytest.mark.parametrize(
    "body,param", COMPLETION_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_CASES)]
)
def test_bad_completion_bodies(http, body, param):
    check_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body,param", CHAT_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_CASES)])
def test_bad_chat_bodies(http, body, param):
    check_error(http.post("/v1/chat/completions", json=body), 400, param)


RAW = [b"", b"{", b"null", b"[]", b"123", b'"str"', b"[" * 100_000, b"\xff\xfe{}", b'{"model": NaN}',
       b'{"model": "random-tiny", "prompt": "x", "temperature": NaN}', b'{"a": 1e400}', b"{" * 50_000,
       b'{"model": "random-tiny", "prompt": "x", "temperature": 1e400}', b'{"model": "random-tiny"} trailing']  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.slow
def test_raw_garbage_is_a_400(http, path):
    for raw in RAW:
        err = check_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert err["param"] in ("body", "model", "temperature", "prompt", "messages", "a"), (raw[:40], err)
    rng = random.Random(0)
    for _ in range(40):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        check_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    for _ in range(40):  # valid JSON objects of random junk
        body = {
            rng.choice(["model", "prompt", "n", "stop", "x"]): rng.choice(
                [None, 1, -1, "s", [], {}, [1, "a"], 2.5]
            )
            for _ in range(3)
        }
        check_error(
            http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}), 400
        )


def test_oversized_body_is_a_413(http):
    big = json.dumps({**OK, "prompt": "x" * (9 << 20)})
    check_error(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413, "body"
    )


def test_server_is_healthy_and_empty_afterwards(server, http):
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    engine = server.app.state.engine.engine
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity and not engine.has_unfinished
    assert server.app.state.engine.inflight == 0
