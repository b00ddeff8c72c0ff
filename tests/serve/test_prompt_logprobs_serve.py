"""vLLM's `prompt_logprobs` on /v1/completions and /v1/chat/completions and chat `echo`, through
the openai client (`extra_body`): each prompt token's log-probability, rank and top k checked
against a whole-sequence forward pass of the same random weights; the bounds and the stream
refusal are 400s naming the field."""

from __future__ import annotations

import pytest
import torch
from helpers import extras
from helpers.serve import MODEL, all_pages_free

openai = extras.require("openai")

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


def spelled(raw: bytes) -> str:
    """A token's text as the server's logprobs spell it (`bytes:\\xNN` when not whole UTF-8)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def check_vllm_shape(entries, ids, oracle, k, server):
    """`entries` is vLLM's prompt_logprobs of prompt `ids`: first null, then the prompt token and
    the top k, each with the oracle's log-probability and rank."""
    tok = server.app.state.llm.tokenizer
    assert len(entries) == len(ids) and entries[0] is None
    want = oracle(ids)
    for i in range(1, len(ids)):
        row, entry = want[i - 1], entries[i]
        assert str(ids[i]) in entry
        assert k <= len(entry) <= k + 1
        for key, item in entry.items():
            t = int(key)
            assert item["logprob"] == pytest.approx(row[t].item(), abs=1e-4)
            assert (
                item["rank"] == int((row > row[t] + 1e-6).sum()) + 1
                or abs(row.sort(descending=True).values[item["rank"] - 1].item() - row[t].item()) < 1e-4
            )  # a near-tie may order either way
            assert item["decoded_token"] == spelled(tok.token_bytes(t))
        if k:
            best = max(entry.values(), key=lambda x: x["logprob"])
            assert best["rank"] == 1 and best["logprob"] == pytest.approx(row.max().item(), abs=1e-4)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_completion_prompt_logprobs_per_choice(client, server, oracle, k):
    prompts = ["The sky is blue", "Fire is hot today"]
    r = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": k}
    )
    tok = server.app.state.llm.tokenizer
    assert len(r.choices) == 2
    for choice in r.choices:
        ids = tok.encode(prompts[choice.index])
        check_vllm_shape(choice.model_extra["prompt_logprobs"], ids, oracle, k, server)
        assert choice.logprobs is None  # completion logprobs were not asked for
    assert all_pages_free(server)


def test_prompt_logprobs_with_echo_keep_each_their_k(client, server, oracle):
    """echo + logprobs 1 scores the prompt with k = 1; prompt_logprobs 4 at once gets its 4."""
    ids = server.app.state.llm.tokenizer.encode("Two plus two is four")
    r = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 4},
    )  # fmt: skip
    (choice,) = r.choices
    check_vllm_shape(choice.model_extra["prompt_logprobs"], ids, oracle, 4, server)
    tops = choice.logprobs.top_logprobs[1 : len(ids)]
    assert all(1 <= len(t) <= 2 for t in tops)  # echo's own k (1), plus the token itself


def test_chat_prompt_logprobs_on_the_response(client, server, oracle):
    messages = [{"role": "user", "content": "hello there"}]
    ids = server.app.state.llm.render_chat(messages, True)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, n=2, seed=3, extra_body={"prompt_logprobs": 2}
    )
    check_vllm_shape(r.model_extra["prompt_logprobs"], ids, oracle, 2, server)


def test_without_prompt_logprobs_there_is_no_field(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=1)
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=1)
    assert "prompt_logprobs" not in (c.model_extra or {})


@pytest.mark.parametrize("value", [-1, 21, 2**70, 1.5, "2", True, [1]])
@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_out_of_bounds_is_a_400(client, server, value, chat):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=1,
                extra_body={"prompt_logprobs": value},
            )  # fmt: skip
        else:
            client.completions.create(
                model=MODEL, prompt="a", max_tokens=1, extra_body={"prompt_logprobs": value}
            )
    assert e.value.body["param"].startswith("prompt_logprobs")
    assert all_pages_free(server)


def test_prompt_logprobs_with_stream_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="a", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert e.value.body["param"] == "prompt_logprobs" and "stream" in e.value.body["message"]


# -- chat echo -----------------------------------------------------------------------------------
def test_chat_echo_continues_the_last_message(client):
    """add_generation_prompt false: the reply continues the last message, and echo puts it first."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False})
    echoed = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False, "echo": True})
    assert echoed.choices[0].message.content == "The answer is" + plain.choices[0].message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


def test_chat_echo_with_a_generation_prompt_after_a_user_echoes_nothing(client):
    """vLLM's rule: a new assistant turn (add_generation_prompt after a user message) continues
    nothing, so echo adds nothing."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    plain = client.chat.completions.create(**kw)
    echoed = client.chat.completions.create(**kw, extra_body={"echo": True})
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_streamed_chat_echo_equals_the_whole_answer(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0,
              extra_body={"add_generation_prompt": False, "echo": True})  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.content == "Sure:"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_prompt_logprobs_beside_plain_requests_harm_none(client, server, oracle):
    """One batch: scored requests (k up to 20) beside plain greedy ones; each plain answer is what
    it is alone, and each scored one is right."""
    from concurrent.futures import ThreadPoolExecutor

    def plain(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text

    def scored(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 20})  # fmt: skip
        return r.choices[0].model_extra["prompt_logprobs"]

    prompts = ["alpha beta", "gamma delta epsilon", "zeta"]
    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        plains = [pool.submit(plain, p) for p in prompts]
        scores = [pool.submit(scored, p) for p in prompts]
        assert [f.result() for f in plains] == alone
        tok = server.app.state.llm.tokenizer
        for p, f in zip(prompts, scores, strict=True):
            check_vllm_shape(f.result(), tok.encode(p), oracle, 20, server)
    assert all_pages_free(server)
