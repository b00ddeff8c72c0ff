"""One request's long prompt must not hold up the others: the server tokenizes (and renders a
chat) in a worker thread, and the HF tokenizer lets go of the GIL while it works. Before, a
prompt that took seconds to tokenize stopped the event loop, and every request on the server
with it, until its 400 came back."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import extras
from helpers.checkpoint import write_checkpoint
from helpers.hf_tokenizers import write_hf_tokenizer
from helpers.serve import all_pages_free

httpx = extras.require("httpx")
extras.require("fastapi")
extras.require("tokenizers")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory, single_thread):
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    folder = tmp_path_factory.mktemp("hf") / "ckpt"
    write_checkpoint(folder)
    write_hf_tokenizer(folder)  # tokenizer.json: the `tokenizers` library encodes
    llm = LLM(model=str(folder), max_num_seqs=4)
    with ServerThread(llm, max_queue=8, strict=True) as srv:
        srv.llm = llm
        yield srv


def test_hf_tokenizer_encode_lets_other_threads_run(hf_server):
    """While one long encode runs, another Python thread keeps running. With the GIL held for the
    whole encode (the defect), the ticker could not run between the two marks at all; no
    wall-clock bound is asserted, only that it ran."""
    from sparsegen.llm.hf_tokenizer import HFTokenizer

    tok = hf_server.llm.tokenizer
    assert isinstance(tok, HFTokenizer)
    text = "a\nb\n" * 60_000
    ticks, started, done = [0], threading.Event(), threading.Event()

    def tick():
        started.set()
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started.wait(10)
    before = ticks[0]
    ids = tok.encode(text)
    during = ticks[0] - before
    done.set()
    ticker.join()
    assert len(ids) == len(text)  # this tiny vocabulary: one token a character here
    assert during >= 3, during  # the other thread went on while encode ran


@pytest.mark.slow
@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/tokenize", "prompt")])
def test_a_long_prompt_does_not_hold_up_a_short_one(hf_server, path, field, monkeypatch):
    """The long prompt's encode is held open (it waits for the test's release) while a short
    request is served: were encoding done on the event loop, the short request could never be
    answered (its client gives up after 60 s) until the release. No wall-clock bound."""
    tok = hf_server.llm.tokenizer  # what /v1/completions (through LLM.encode) and /tokenize call
    entered, release = threading.Event(), threading.Event()
    real_encode = tok.encode

    def held_encode(text, *args, **kwargs):
        if isinstance(text, str) and len(text) > 100_000:
            entered.set()
            release.wait(120)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", held_encode)
    with httpx.Client(base_url=hf_server.url, timeout=60) as c:
        name = c.get("/v1/models").json()["data"][0]["id"]
        long = {
            "model": name,
            field: "a\nb\n" * 100_000,
            **({"max_tokens": 1} if "completions" in path else {}),
        }
        finished = {}

        def send_long():
            with httpx.Client(base_url=hf_server.url, timeout=180) as c2:
                r = c2.post(path, json=long)
            finished["long"] = (r.status_code, r.text[:200])

        worker = threading.Thread(target=send_long)
        worker.start()
        try:
            assert entered.wait(60), "the long prompt never reached the tokenizer"
            r = c.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            health = c.get("/health")
            assert "long" not in finished  # still held: the short one was answered meanwhile
        finally:
            release.set()
            worker.join()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text[:300]
    assert health.status_code == 200
    status, text = finished["long"]
    if "completions" in path:
        assert status == 400 and "400000 tokens; the model takes at most" in text, text
    else:
        assert status == 200 and '"count":400000' in text, text
    assert all_pages_free(hf_server)
