"""Prefix caching through the server: `usage.prompt_tokens_details.cached_tokens` as the real
`openai` client reads it, on a repeated 400-token prefix; the same greedy text either way."""

from __future__ import annotations

import uuid

import pytest
from helpers import extras

openai = extras.require("openai")
extras.require("fastapi")
from helpers.serve import all_pages_free  # noqa: E402

from sparsegen import LLM  # noqa: E402
from sparsegen.serve.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "random-tiny"
# 407 byte tokens, led by a nonce: the served model is shared with other suites (in any order),
# so a prefix any of them could have sent before would already be cached here
SYSTEM = f"{uuid.uuid4().hex[:8]} " + "You are a careful assistant. " * 14 + "Answer briefly."[9:]
assert len(SYSTEM) >= 400


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, question: str, system: str = SYSTEM, **kw):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, **kw)


def test_a_repeated_400_token_prefix_is_served_from_the_cache(client, server):
    system = f"{uuid.uuid4().hex[:8]} {SYSTEM[9:]}"  # no other test of this server sent it
    first = ask(client, "What is a page?", system)
    again = ask(client, "What is a page?", system)
    other = ask(client, "And a block?", system)
    assert first.usage.prompt_tokens > 400
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert other.usage.prompt_tokens_details.cached_tokens >= 400 // 16 * 16 - 16
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    stats = server.app.state.llm.stats()
    assert stats.prefix_cache_hits >= 16 and stats.prefix_cache_queries >= 3 * 400
    assert all_pages_free(server)


def test_the_stream_usage_chunk_has_cached_tokens(client, server):
    ask(client, "Streamed?")
    stream = ask(client, "Streamed?", stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 16
    assert all_pages_free(server)


def test_completions_report_cached_tokens_and_caching_can_be_off(client):
    prompt = SYSTEM + " Q:"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    hit = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16
    with ServerThread(LLM(random="tiny", max_num_seqs=2, enable_prefix_caching=False), max_queue=2) as srv:
        off = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(2):
            miss = off.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
            assert miss.usage.prompt_tokens_details.cached_tokens == 0
        assert miss.choices[0].text == hit.choices[0].text
