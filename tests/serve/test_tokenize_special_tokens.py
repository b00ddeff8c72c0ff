"""`add_special_tokens` on /tokenize, /v1/completions and /v1/chat/completions with vLLM's meaning,
on a checkpoint whose tokenizer.json adds a BOS (`<s>`, as Llama's does): a text prompt gets the
BOS by default and /tokenize says so with the ids /v1/completions runs; messages get what the
chat template writes, and true adds the tokenizer's BOS on top. transformers is the oracle."""

from __future__ import annotations

import pytest
from helpers import extras
from helpers.checkpoint import TINY_HF_CONFIG, write_checkpoint
from helpers.hf_tokenizers import write_hf_tokenizer
from helpers.serve import all_pages_free

httpx = extras.require("httpx")
extras.require("fastapi")
extras.require("tokenizers")
transformers = extras.require("transformers")

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT = "hello world, the quick fox"
CHAT = [{"role": "user", "content": "what is two plus two?"}]


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory, single_thread):
    from tokenizers import Tokenizer

    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    folder = tmp_path_factory.mktemp("bos") / "ckpt"
    write_hf_tokenizer(folder, bos=True)  # TemplateProcessing "<s> $A", as Llama's tokenizer.json
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    write_checkpoint(folder, cfg={**TINY_HF_CONFIG, "vocab_size": vocab})  # the tokenizer's ids, no more
    llm = LLM(model=str(folder), max_num_seqs=2)
    with ServerThread(llm, max_queue=4, strict=True) as srv:
        srv.hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        yield srv


@pytest.fixture(scope="module")
def http(bos_server):
    with httpx.Client(base_url=bos_server.url, timeout=60) as c:
        c.model = c.get("/v1/models").json()["data"][0]["id"]
        yield c


def _post(http, path: str, body: dict) -> httpx.Response:
    return http.post(path, json={"model": http.model, **body})


def test_tokenize_a_prompt_adds_the_bos_by_default(bos_server, http):
    hf = bos_server.hf
    default = _post(http, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    assert default == hf(TEXT)["input_ids"] and default[0] == hf.bos_token_id
    plain = _post(http, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert plain == hf(TEXT, add_special_tokens=False)["input_ids"] == default[1:]


def test_tokenizer_info_names_the_bos(http):
    assert http.get("/tokenizer_info").json()["bos_token"] == "<s>"


@pytest.mark.parametrize("special", [None, True, False])
def test_tokenize_counts_what_completions_runs(bos_server, http, special):
    extra = {} if special is None else {"add_special_tokens": special}
    told = _post(http, "/tokenize", {"prompt": TEXT, **extra}).json()
    r = _post(http, "/v1/completions", {"prompt": TEXT, "max_tokens": 1, "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == told["count"]
    echoed = _post(
        http, "/v1/completions", {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0, **extra}
    ).json()
    tokens = echoed["choices"][0]["logprobs"]["tokens"]
    assert tokens == [bos_server.hf.convert_tokens_to_string([t]) for t in
                      bos_server.hf.convert_ids_to_tokens(told["tokens"])]  # fmt: skip
    assert (tokens[0] == "<s>") == (special is not False)
    assert all_pages_free(bos_server)


def test_token_id_prompts_are_taken_as_they_are(bos_server, http):
    ids = bos_server.hf(TEXT, add_special_tokens=False)["input_ids"]
    r = _post(http, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == len(ids)  # add_special_tokens touches text only


def test_tokenize_messages_the_template_decides(bos_server, http):
    hf = bos_server.hf
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(want, dict) or hasattr(want, "input_ids"):  # newer transformers return a BatchEncoding
        want = want["input_ids"]
    default = _post(http, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert default == want and default.count(hf.bos_token_id) == 1  # the template's BOS, once
    doubled = _post(http, "/tokenize", {"messages": CHAT, "add_special_tokens": True}).json()["tokens"]
    assert doubled == [hf.bos_token_id, *default]
    chat = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(default)
    chat = _post(
        http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "add_special_tokens": True}
    )
    assert chat.json()["usage"]["prompt_tokens"] == len(doubled)


@pytest.mark.parametrize("value", [1, 0, "true", None, [], 0.0])
@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": TEXT}), ("/v1/completions", {"prompt": TEXT, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
])  # fmt: skip
def test_add_special_tokens_must_be_a_bool(http, path, body, value):
    r = _post(http, path, {**body, "add_special_tokens": value})
    if value is None and path == "/tokenize":  # null is the default there: by the kind of input
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("add_special_tokens")


def test_an_id_past_the_tokenizer_but_inside_the_model_decodes_to_nothing(tmp_path):
    """Qwen2's embedding has rows past its tokenizer's ids: a sampled one must not fail the
    request (it did, inside the output step: 'outside the vocabulary')."""
    from tokenizers import Tokenizer

    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    folder = tmp_path / "padded"
    write_hf_tokenizer(folder)
    n = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    write_checkpoint(folder, cfg={**TINY_HF_CONFIG, "vocab_size": n + 64})
    with ServerThread(LLM(model=str(folder), max_num_seqs=2), max_queue=4, strict=True) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "hello", "max_tokens": 3, "allowed_token_ids": [n + 5],
                    "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == [n + 5] * 3 and choice["text"] == ""
            assert c.get("/health").status_code == 200
        assert all_pages_free(srv)
