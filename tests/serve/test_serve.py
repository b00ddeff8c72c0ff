"""`sparsegen serve` over HTTP with the real openai client: a tiny random model on 127.0.0.1.

Expected outputs come from a second `LLM` with the same random weights (the server's engine
belongs to its own thread). Every test is bounded in time; pages are checked free at the end.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import extras

httpx = extras.require("httpx")
openai = extras.require("openai")
extras.require("fastapi")
from helpers.serve import all_pages_free  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sparsegen import LLM, SamplingParams  # noqa: E402
from sparsegen.serve.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "random-tiny"


@pytest.fixture(scope="module")
def ref(single_thread):
    return LLM(random="tiny", max_num_seqs=8)


@pytest.fixture(scope="module")
def server(single_thread):
    llm = LLM(random="tiny", max_num_seqs=32)
    with ServerThread(llm, max_queue=64) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_completions_greedy_equals_llm_generate(client, ref):
    want = ref.generate("Hello", SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    got = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_greedy_equals_llm_chat(client, ref):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    want = ref.chat(msgs, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    got = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_sampling_fields_reach_the_engine(client, ref, server):
    p = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, logprobs=2)
    want = ref.generate([list(b"seeded")], p, use_tqdm=False)[0]
    got = client.completions.create(
        model=MODEL, prompt=list(b"seeded"), n=3, max_tokens=8, temperature=1.0, seed=11, logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    by_index = sorted(got.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in by_index] == [o.token_ids for o in want.outputs]
    for c, o in zip(by_index, want.outputs, strict=True):
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in o.logprobs], abs=1e-5)
        assert all(x <= 0 for x in c.logprobs.token_logprobs) and all(
            len(t) == 2 for t in c.logprobs.top_logprobs
        )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=3,
        seed=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    # seeded, and EOS ignored; a turn-end token (a stop token, not EOS) may still end it early
    content, finish = chat.choices[0].logprobs.content, chat.choices[0].finish_reason
    assert len(content) == 4 or (finish == "stop" and 1 <= len(content) < 4), (len(content), finish)
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # a stop string ends the request and frees its pages at once
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = next(
        text[i : i + 2]
        for i in range(len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == text[: text.find(stop)] and got.choices[0].finish_reason == "stop"
    assert all_pages_free(server)


@pytest.mark.slow
def test_32_concurrent_streams_equal_solo_runs(server, ref):
    prompts = [f"client {i}: " + "ab" * (i % 5) for i in range(32)]
    solo = [
        ref.generate([p], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0] for p in prompts
    ]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        ids, text = [], ""
        async for chunk in stream:
            ids += chunk.choices[0].model_extra.get("token_ids", [])
            text += chunk.choices[0].text
        return ids, text

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
        ) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, p) for p in prompts)), 60)

    results = asyncio.run(main())
    for (ids, text), want in zip(results, solo, strict=True):
        assert ids == want.token_ids and text == want.text
    assert all_pages_free(server)
    assert metric(server, "sparsegen_kv_pages_used") == 0


def test_disconnect_mid_stream_frees_pages(server):
    body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert all(x.startswith("data: ") or x == "" for x in got)
            assert server.app.state.engine.engine.has_unfinished
    assert all_pages_free(server, timeout=10)  # 3000 tokens would take far longer
    # a non-streaming client that gives up is cancelled too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    assert all_pages_free(server, timeout=10)


def test_models_health_metrics(server, client):
    before = metric(server, "sparsegen_generation_tokens_total")
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    for name in ("sparsegen_queue_depth", "sparsegen_requests_running", "sparsegen_kv_pages_total"):
        metric(server, name)
    assert metric(server, "sparsegen_generation_tokens_total") >= before + 3  # this test's own request
    assert (
        metric(server, "sparsegen_kv_pages_total") == server.app.state.engine.engine.cache.allocator.capacity
    )
    r = httpx.get(server.url + "/nope", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_full_queue_gets_503(single_thread):
    llm = LLM(random="tiny", max_num_seqs=1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with ServerThread(llm, max_queue=1) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with (
            c.stream("POST", "/v1/completions", json=body) as a,
            c.stream("POST", "/v1/completions", json=body) as b,
        ):
            assert a.status_code == 200 and b.status_code == 200
            r = c.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "queue is full" in err["message"]
            r = c.post("/v1/completions", json={**body, "n": 2})
            assert r.status_code == 503
            r = c.post("/v1/completions", json={**body, "n": 3})  # more than the server ever takes
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert all_pages_free(srv)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] <= 2


def test_a_failed_step_fails_its_requests_not_the_server(server, monkeypatch):
    engine = server.app.state.engine.engine
    real, calls = engine.step, [0]

    def flaky():
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected step failure")
        return real()

    monkeypatch.setattr(engine, "step", flaky)
    body = {"model": MODEL, "prompt": "boom", "max_tokens": 8, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    calls[0] = 0  # the stream's second step fails, after its first token went out
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and "injected step failure" in lines[-2]
    monkeypatch.undo()
    assert all_pages_free(server)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_requests_larger_than_the_kv_cache_are_400(single_thread):
    llm = LLM(random="tiny", num_pages=5)  # 4 usable pages of 16 tokens
    with ServerThread(llm) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "0123456789", "max_tokens": 60})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and "KV cache" in err["message"]
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "ignore_eos": True})
        assert r.status_code == 200  # without max_tokens, the reply may take what the cache has left
        assert r.json()["usage"]["total_tokens"] == 64 and r.json()["choices"][0]["finish_reason"] == "length"
