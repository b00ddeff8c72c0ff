"""Every field of /v1/completions, /v1/chat/completions, /tokenize and /detokenize against the same
hostile values (wrong types, bounds, NaN/inf, huge ints, lone surrogates, empty and nested
containers): each answer is a 200 or a 4xx OpenAI error naming the field, never a 5xx, and every
KV page is back afterwards. Content types a browser can send without a preflight are refused."""

from __future__ import annotations

import json
import math

import pytest
from helpers import extras

httpx = extras.require("httpx")
extras.require("fastapi")
from helpers.serve import CHAT, MODEL, OK, all_pages_free  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]  # ~1,800 requests in all

VALUES = [None, True, False, 0, 1, -1, 2**31, 2**63, 2**64, 2**70, -(2**70), 0.5, 1e-45, 1e-300, 1e308,
          math.nan, math.inf, -math.inf, "", "x", "\ud800", [], [1], {}, {"a": 1}, "1"]  # fmt: skip
COMPLETION_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "logprobs",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
                     "ignore_eos", "logit_bias", "allowed_token_ids", "include_stop_str_in_output",
                     "skip_special_tokens", "user", "stream", "prompt", "model", "best_of", "return_token_ids",
                     "prompt_logprobs", "echo"]  # fmt: skip
CHAT_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
               "logprobs", "top_logprobs", "logit_bias", "allowed_token_ids", "add_generation_prompt", "messages",
               "include_stop_str_in_output", "stream", "stream_options", "tools", "tool_choice",
               "parallel_tool_calls", "repetition_penalty", "user", "prompt_logprobs", "echo"]  # fmt: skip
TOKENIZE = {"model": MODEL, "prompt": "hi"}
DETOKENIZE = {"model": MODEL, "tokens": [1, 2]}


def _post(http, path: str, body: dict) -> httpx.Response:
    return http.post(
        path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
    )


def _answered(r: httpx.Response, field: str) -> None:
    assert r.status_code == 200 or 400 <= r.status_code < 500, (field, r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and (err["param"] or "").split("[")[0].split(".")[0] in (field, "body"), (
            field,
            err,
        )


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_completion_field(server, http, field):
    for value in VALUES:
        _answered(_post(http, "/v1/completions", {**OK, field: value}), field)
    assert all_pages_free(server)


@pytest.mark.parametrize("field", CHAT_FIELDS)
def test_chat_field(server, http, field):
    for value in VALUES:
        _answered(_post(http, "/v1/chat/completions", {**CHAT, field: value}), field)
    assert all_pages_free(server)


@pytest.mark.parametrize("path,base,fields", [
    ("/tokenize", TOKENIZE, ["prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs", "model"]),
    ("/detokenize", DETOKENIZE, ["tokens", "model"]),
])  # fmt: skip
def test_tokenize_fields(server, http, path, base, fields):
    for field in fields:
        for value in VALUES:
            _answered(_post(http, path, {**base, field: value}), field)


MESSAGES = [
    [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": "\x00"}], [None], [5], [[]],
    [{"role": None, "content": "x"}], [{"content": "x"}], [{"role": "USER", "content": "x"}],
    [{"role": "user", "content": {"text": "x"}}], [{"role": "user", "content": "a"}] * 3000,
    [{"role": "user", "content": "{% for i in range(10**9) %}x{% endfor %}"}],
]  # fmt: skip


@pytest.mark.parametrize("messages", MESSAGES, ids=[f"m{i}" for i in range(len(MESSAGES))])
def test_chat_messages(server, http, messages):
    _answered(_post(http, "/v1/chat/completions", {**CHAT, "messages": messages}), "messages")
    assert all_pages_free(server)


SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "",
                "application/jsonx", "application/json-patch+json", "application/*"]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_only_json_is_taken(http, path):
    body = json.dumps(DETOKENIZE if path == "/detokenize" else {**OK, **CHAT} if "chat" in path else OK)
    for media in SIMPLE_TYPES:
        r = http.post(path, content=body, headers={"content-type": media})
        assert r.status_code == 415, (media, r.status_code, r.text[:200])
    for media in ("application/json", "APPLICATION/JSON", "application/json; charset=utf-8"):
        r = http.post(path, content=body, headers={"content-type": media})
        assert r.status_code in (200, 400), (media, r.status_code, r.text[:200])
