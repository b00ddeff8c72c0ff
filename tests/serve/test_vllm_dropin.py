"""Issue 32's acceptance: `sparsegen serve` started as a vLLM user starts vLLM (its flag spellings,
in a subprocess), then driven by the official `openai` client the way vLLM's users drive it: the
401 without the key, vLLM's extra fields and roles, an lm-eval-shaped loglikelihood request,
/tokenize, `cached_tokens` on a repeated 400-token prefix, a `json_schema` reply that parses and
validates, and vLLM's metric names."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import extras

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KEY = "k-dropin"
MODEL = "acme/tiny"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _wait_for_url(proc: subprocess.Popen, timeout: float = 180) -> str:
    os.set_blocking(proc.stderr.fileno(), False)
    seen, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.read() or b""
        found = re.search(rb"on (http://127\.0\.0\.1:\d+)", seen)
        if found:
            return found.group(1).decode()
        time.sleep(0.05)
    raise AssertionError(f"the server did not come up: {seen.decode('utf-8', 'replace')[-2000:]}")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    extras.require("fastapi")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(tmp_path_factory.mktemp("c"))}
    env.pop("SPARSEGEN_API_KEY", None)
    args = ["serve", "--random", "tiny", "--port", "0", "--no-warmup", "--served-model-name", MODEL,
            "--api-key", KEY, "--dtype", "auto", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--tensor-parallel-size", "1", "--enforce-eager", "--seed", "0", "--kv-cache-dtype", "auto"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsegen", *args], stderr=subprocess.PIPE, env=env, cwd=ROOT
    )
    try:
        yield _wait_for_url(proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def client(url):
    openai = extras.require("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_without_the_key_it_is_401(url):
    openai = extras.require("openai")
    anon = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()


def test_vllm_fields_and_roles_are_taken(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=3,
        metadata={"run": "dropin"},
        store=False,
        stream_options=None,
        extra_body={"top_k": 5, "min_tokens": 1, "service_tier": "auto"},
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens >= 1


def test_an_lm_eval_loglikelihood_request_scores_the_prompt(client):
    reply = client.completions.create(
        model=MODEL, prompt="The sky is blue", echo=True, logprobs=1, max_tokens=1
    )
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith("The sky is blue")
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len("The sky is blue") + 1  # byte tokens + 1 new


def test_tokenize_and_detokenize(url):
    httpx = extras.require("httpx")
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=auth).json()[
        "tokens"
    ]
    assert len(ids) == 5
    text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": ids}, headers=auth).json()[
        "prompt"
    ]
    assert text == "hello"


def test_a_repeated_400_token_prefix_is_cached(client):
    prefix = "".join(chr(97 + (7 * i) % 26) for i in range(400))  # 400 byte tokens
    client.completions.create(model=MODEL, prompt=prefix + " one", max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prefix + " two", max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_a_json_schema_reply_parses_and_validates(client):
    jsonschema = extras.require("jsonschema")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=300,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_vllm_metric_names(url, client):
    httpx = extras.require("httpx")
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries"):  # fmt: skip
        assert name in text, name
    assert f'model_name="{MODEL}"' in text
