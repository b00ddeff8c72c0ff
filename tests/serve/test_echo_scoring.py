"""Scoring through the openai client: `/v1/completions` with `echo` and `logprobs` as lm-eval's
local-completions sends it (`max_tokens` 0 or 1, prompts as text, token ids or lists of them),
checked against a whole-sequence forward pass of the same random weights; the adversarial
cases (max_tokens 0 without echo, too many logprobs, empty prompts, a client leaving a stream
with echo); spaces_between_special_tokens and the queue-time histogram."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from helpers import extras
from helpers.serve import MODEL, all_pages_free

openai = extras.require("openai")
httpx = extras.require("httpx")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oracle():
    """log-probabilities [T, V] of a token list by one whole-sequence forward of the same weights
    (LLM(random="tiny") builds them from seed 0, as the served one)."""
    from sparsegen import LLM
    from sparsegen.models.batch import ForwardBatch

    model = LLM(random="tiny", max_num_seqs=1).engine.model

    def lp(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor(ids), ForwardBatch.whole_sequences([len(ids)]))
        return torch.log_softmax(logits.double(), dim=-1)

    return lp


def encode(server, text: str) -> list[int]:
    return server.app.state.llm.tokenizer.encode(text)


def check_prompt_part(lp, ids, oracle, k):
    """The first len(ids) entries of a choice's logprobs score the prompt as the oracle does."""
    n = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = oracle(ids)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and top[lp.tokens[i]] == lp.token_logprobs[i]  # the token itself
        assert k <= len(top) <= k + 1
        assert max(top.values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[0] == 0


def test_lm_eval_loglikelihood_request(client, server, oracle):
    """What lm-eval sends: token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0."""
    prompts = [encode(server, "The sky is blue"), encode(server, "Fire is hot")]
    r = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    assert len(r.choices) == 2
    for choice, ids in zip(sorted(r.choices, key=lambda c: c.index), prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        check_prompt_part(lp, ids, oracle, 1)
        assert lp.token_logprobs[-1] == pytest.approx(oracle(ids)[-1].max().item(), abs=1e-4)  # greedy
        text = server.app.state.llm.tokenizer.decode(ids)
        assert choice.text.startswith(text) and len(choice.text) > len(text)
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 2


def test_echo_without_generation_is_the_prompt_alone(client, server, oracle):
    ids = encode(server, "Two plus two is four")
    r = client.completions.create(
        model=MODEL, prompt="Two plus two is four", echo=True, logprobs=2, max_tokens=0
    )
    (choice,) = r.choices
    assert choice.text == "Two plus two is four"
    assert len(choice.logprobs.tokens) == len(ids)
    check_prompt_part(choice.logprobs, ids, oracle, 2)
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens == len(ids)


def test_echo_without_logprobs_prefixes_the_text(client):
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "abc" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


def test_echo_with_n_choices_and_a_token_prompt(client, server):
    ids = encode(server, "xyz")
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=2, n=2, seed=5)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.text.startswith("xyz") and c.logprobs.tokens[:3] == ["x", "y", "z"]
        assert c.logprobs.top_logprobs[1] == {"y": c.logprobs.token_logprobs[1]}  # k = 0: the token only


def test_streamed_echo_equals_the_whole_answer(client):
    kw = dict(model=MODEL, prompt="stream me", echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text.startswith("stream me")
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streamed_echo_only_sends_the_prompt(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="only", echo=True, logprobs=1, max_tokens=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == "only"
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == ["o", "n", "l", "y"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 is for scoring, with echo only
        ({"prompt": "hi", "max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
        ({"prompt": "hi", "echo": True, "logprobs": 21, "max_tokens": 1}, "logprobs"),  # vLLM's max_logprobs
        ({"prompt": "hi", "echo": True, "logprobs": 10**9, "max_tokens": 1}, "logprobs"),
        ({"prompt": "hi", "echo": True, "logprobs": -1, "max_tokens": 1}, "logprobs"),
        ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
        ({"prompt": "", "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
        ({"prompt": [], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
        ({"prompt": [[]], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
        ({"prompt": [[1, 2], []], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
        ({"prompt": [1, 99999], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
        ({"prompt": "hi", "echo": "yes", "max_tokens": 1}, "echo"),
    ],
)
def test_bad_scoring_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and param in err["param"], err


def test_echo_with_the_most_logprobs(client, server, oracle):
    ids = encode(server, "twenty")
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=20, max_tokens=1)
    check_prompt_part(r.choices[0].logprobs, ids, oracle, 20)


def test_prompt_at_the_context_limit_is_refused_for_scoring(http, server):
    limit = server.app.state.llm.max_model_len
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [65] * limit, "echo": True, "logprobs": 1, "max_tokens": 0},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_leaving_a_streamed_echo_frees_every_page(server):
    body = json.dumps(
        {"model": MODEL, "prompt": "leave", "echo": True, "logprobs": 5, "max_tokens": 400, "stream": True,
         "ignore_eos": True, "temperature": 1.0}
    ).encode()  # fmt: skip
    s = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    s.sendall(head + body)
    got = b""
    while b"leave" not in got:  # the echoed prompt came in the first chunk
        more = s.recv(4096)
        assert more, got
        got += more
    s.close()
    assert all_pages_free(server, timeout=30)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_spaces_between_special_tokens(client, server):
    user = server.app.state.llm.tokenizer.special_tokens["<|user|>"]
    kw = dict(model=MODEL, prompt="a", max_tokens=2, temperature=0)
    extra = {"skip_special_tokens": False, "allowed_token_ids": [user], "ignore_eos": True}
    spaced = client.completions.create(**kw, extra_body=extra).choices[0].text
    joined = client.completions.create(**kw, extra_body={**extra, "spaces_between_special_tokens": False})
    assert spaced == "<|user|> <|user|>" and joined.choices[0].text == "<|user|><|user|>"


def test_queue_time_histogram_with_model_name(client, server):
    def count() -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("vllm:request_queue_time_seconds_count{")]
        assert len(lines) == 1 and f'model_name="{MODEL}"' in lines[0], lines
        return float(lines[0].rsplit(" ", 1)[1])

    before = count()
    client.completions.create(model=MODEL, prompt="q", max_tokens=1, n=2, seed=1)
    assert count() == before + 2  # one per completion (each a sequence of its own)


def test_tokenizer_info_is_vllms_shape(http, server):
    info = http.get("/tokenizer_info").json()
    assert (
        info["eos_token"] == "<|endoftext|>"
        and info["model_max_length"] == server.app.state.llm.max_model_len
    )
    assert "{%" in info["chat_template"] and info["vocab_size"] == server.app.state.llm.vocab_size
