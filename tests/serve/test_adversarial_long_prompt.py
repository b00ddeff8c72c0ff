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
    from sparsegen.llm.hf_tokenizer import HFTokenizer

    tok = hf_server.llm.tokenizer
    assert isinstance(tok, HFTokenizer)
    text = "a\nb\n" * 60_000
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    ids = tok.encode(text)
    took = time.monotonic() - start
    done.set()
    ticker.join()
    assert len(ids) == len(text)  # this tiny vocabulary: one token a character here
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert took > 0.3 and max(gaps) < took / 2, (took, max(gaps))  # the other thread went on


@pytest.mark.slow
@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/tokenize", "prompt")])
def test_a_long_prompt_does_not_hold_up_a_short_one(hf_server, path, field):
    with httpx.Client(base_url=hf_server.url, timeout=120) as c:
        name = c.get("/v1/models").json()["data"][0]["id"]
        long = {
            "model": name,
            field: "a\nb\n" * 100_000,
            **({"max_tokens": 1} if "completions" in path else {}),
        }
        finished = {}

        def send_long():
            with httpx.Client(base_url=hf_server.url, timeout=120) as c2:
                r = c2.post(path, json=long)
            finished["long"] = (time.monotonic(), r.status_code, r.text[:200])

        worker = threading.Thread(target=send_long)
        worker.start()
        time.sleep(0.5)  # the long prompt is being tokenized now
        r = c.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        good_done = time.monotonic()
        health = c.get("/health")
        worker.join()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text[:300]
    assert health.status_code == 200
    long_done, status, text = finished["long"]
    if "completions" in path:
        assert status == 400 and "400000 tokens; the model takes at most" in text, text
    else:
        assert status == 200 and '"count":400000' in text, text
    assert long_done - good_done > 0.5, (long_done, good_done)  # the short one did not wait for it
    assert all_pages_free(hf_server)
