"""vLLM's server surface with the openai client: the API key, lenient fields, roles, /tokenize."""

from __future__ import annotations

import logging
import uuid

import pytest
from helpers import extras
from helpers.serve import CHAT, MODEL, OK

openai = extras.require("openai")
httpx = extras.require("httpx")

KEY = "sk-test-3f9a"


@pytest.fixture(scope="module")
def server(single_thread):
    extras.require("fastapi")
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    with ServerThread(LLM(random="tiny", max_num_seqs=4), max_queue=8, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"authorization": f"Bearer {KEY}"}) as c:
        yield c


# -- the API key ------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["wrong", KEY + "x", KEY[:-1], ""])
def test_wrong_key_is_401_with_openai_error(server, key):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "none", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401
    err = info.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}, {"authorization": "Bearer"},
     {"authorization": f"Bearer  {KEY}x"}],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/models", "/tokenize"])
def test_missing_or_malformed_authorization(server, headers, path):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = (
            c.post(path, json={"prompt": "hi"}, headers=headers)
            if path == "/tokenize"
            else c.get(path, headers=headers)
        )
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_need_no_key(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_right_key_serves(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


# -- request fields and roles ---------------------------------------------------------------------
def test_vllm_accepted_fields(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=2, metadata={"k": "v"}, store=False,
        service_tier="auto", reasoning_effort="low", user="u1", parallel_tool_calls=False,
    )  # fmt: skip
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 2


def test_include_stop_str_in_output(client):
    """A free run's text gives a stop string that must occur; with the flag it ends the text."""
    free = client.completions.create(model=MODEL, prompt="hi", max_tokens=12, temperature=0).choices[0].text
    stop = free[3:5]
    assert len(stop) == 2
    cut = client.completions.create(model=MODEL, prompt="hi", max_tokens=12, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt="hi", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})  # fmt: skip
    before = free[: free.index(stop)]
    assert cut.choices[0].text == before and kept.choices[0].text == before + stop


def test_unknown_fields_are_dropped_and_logged_once(http, caplog):
    # fresh names: each field path is logged once per process, whatever ran before
    top, inner = f"frobnicate_{uuid.uuid4().hex[:8]}", f"zap_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="sparsegen"):
        for _ in range(3):
            r = http.post("/v1/completions", json={**OK, top: 1, "stream": True,
                                                 "stream_options": {"include_usage": True, inner: 2}})  # fmt: skip
            assert r.status_code == 200, r.text
            assert "data: [DONE]" in r.text
    said = [rec.getMessage() for rec in caplog.records if "unknown request field" in rec.getMessage()]
    assert sorted(said) == sorted(
        [
            f"ignoring the unknown request field '{top}' (--strict refuses it)",
            f"ignoring the unknown request field 'stream_options.{inner}' (--strict refuses it)",
        ]
    ), said


def test_unknown_field_with_another_fault_is_still_400(http):
    r = http.post("/v1/completions", json={**OK, "frobnicate": 1, "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},  # three tokens every time: a sampled EOS would end it early
        )
    )  # fmt: skip
    content = [c for c in chunks if c.choices]
    assert content and all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == 3


def test_usage_only_at_the_end_without_continuous_stats(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.usage is None for c in chunks if c.choices) and chunks[-1].usage.completion_tokens == 3


def test_developer_tool_and_tool_calls_roles(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert out.usage.completion_tokens == 2
    llm = server.app.state.llm
    as_system = [{**messages[0], "role": "system"}, *messages[1:]]
    assert out.usage.prompt_tokens == len(llm.render_chat(as_system))
    rendered = llm.chat_template.render(messages)
    assert "<|system|>\nbe brief" in rendered and "<|tool|>\n42" in rendered


@pytest.mark.parametrize(
    "message,param",
    [
        ({"role": "tool", "content": "42"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls"),
        ({"role": "assistant", "content": None}, "content"),
        ({"role": "robot", "content": "x"}, "role"),
    ],
)
def test_bad_role_fields_are_400(http, message, param):
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": [message]})
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"], r.text


# -- /tokenize and /detokenize --------------------------------------------------------------------
def test_tokenize_prompt_and_detokenize_round_trip(http, server):
    llm = server.app.state.llm
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello, world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == llm.tokenizer.encode("Hello, world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == llm.max_model_len
    assert "".join(body["token_strs"]) == "Hello, world"
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello, world"}


def test_tokenize_messages_matches_chat_prompt(http, client, server):
    messages = [{"role": "developer", "content": "sys"}, {"role": "user", "content": "hi there"}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.json()["count"] == out.usage.prompt_tokens
    assert r.json()["token_strs"] is None


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),
        ("/tokenize", {"prompt": 5}, 400),
        ("/tokenize", {"prompt": "a", "model": "other"}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
        ("/detokenize", {}, 400),
    ],
)
def test_bad_tokenize_bodies(http, path, body, status):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenize_needs_json_content_type(http):
    r = http.post("/tokenize", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415


# -- metrics ----------------------------------------------------------------------------------------
def test_vllm_metric_names_with_model_name(client, server):
    client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
    )
    with httpx.Client(base_url=server.url, timeout=30) as c:
        text = c.get("/metrics").text
    lab = f'model_name="{MODEL}"'
    for series in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        lines = [ln for ln in text.splitlines() if ln.startswith(series + "{") and lab in ln]
        assert len(lines) == 1, (series, lines)
    values = {
        ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:")
    }
    assert (
        values["vllm:generation_tokens_total"] >= 4 and values["vllm:inter_token_latency_seconds_count"] >= 3
    )
    assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0
    assert values["vllm:prefix_cache_hits_total"] == 0.0  # no prefix cache in this engine yet
    assert f'vllm:request_success_total{{finished_reason="length",{lab}}}' in text
