"""`sparsegen serve --tp 2` on the CPU: the HTTP server over two gloo tensor-parallel ranks.

The expected tokens come from a one-process `LLM` with the same random weights (tensor
parallelism must not change a token). One TP engine is started for the whole module (spawning
two ranks costs seconds on a 2-core machine); the test that kills a rank on purpose starts one
of its own, so the tests pass in any order.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import extras

httpx = extras.require("httpx")
extras.require("fastapi")

from sparsegen import LLM, SamplingParams  # noqa: E402
from sparsegen.serve.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "random-tiny"
PROMPT = "the quick brown fox " * 3


@pytest.fixture(scope="module")
def ref(single_thread):
    return LLM(random="tiny", device="cpu", max_num_seqs=8)


def _tp_llm():
    return LLM(random="tiny", device="cpu", tensor_parallel_size=2, max_num_seqs=8)


@pytest.fixture(scope="module")
def tp_llm(single_thread):
    llm = _tp_llm()
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(tp_llm):
    with ServerThread(tp_llm, max_queue=16) as srv:
        yield srv


@pytest.fixture
def doomed():
    """A TP engine and its server of their own, for a test that kills a rank."""
    llm = _tp_llm()
    try:
        with ServerThread(llm, max_queue=16) as srv:
            yield srv, llm
    finally:
        llm.engine.close()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_tp2_completions_equal_one_process(server, ref):
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [list(range(1, 40)), [5, 6, 7]]  # longer than a sparse block of the tiny model, and short
    want = ref.generate(prompts, greedy, use_tqdm=False)
    body = {"prompt": prompts, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    got = post(server, body)
    assert got.status_code == 200, got.text
    choices = sorted(got.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [w.outputs[0].token_ids for w in want]
    assert [c["text"] for c in choices] == [w.outputs[0].text for w in want]
    seeded = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    want_n = ref.generate([PROMPT], seeded, use_tqdm=False)[0]
    got_n = post(server, {"prompt": PROMPT, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 7,
                          "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    by_index = sorted(got_n.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in by_index] == [o.token_ids for o in want_n.outputs]


def test_tp2_stream_and_metrics(server, ref, tp_llm):
    want = ref.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == want.outputs[0].text
    total = metric(server, "sparsegen_kv_pages_total")
    assert total == tp_llm.stats().kv_pages_total == tp_llm.engine.kv_capacity[0] > 0
    deadline = time.monotonic() + 10
    while metric(server, "sparsegen_kv_pages_used") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "sparsegen_kv_pages_used") == 0  # every finished request freed its pages
    too_long = post(server, {"prompt": [1] * 4, "max_tokens": tp_llm.max_model_len})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"


@pytest.mark.slow
def test_tp2_a_lost_rank_fails_requests_and_health(doomed):
    """Rank 1 killed: requests fail naming it, health turns 503, and the engine cannot run again."""
    server, tp_llm = doomed
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    tp_llm.engine.executor.procs[1].kill()
    tp_llm.engine.executor.procs[1].join(10)
    res = post(server, {"prompt": [1, 2, 3], "max_tokens": 4})
    assert res.status_code in (500, 503) and "rank 1" in res.json()["error"]["message"], res.text
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    again = post(server, {"prompt": [1, 2, 3], "max_tokens": 4})
    assert again.status_code == 503
    tp_llm.engine.abort(0)  # cleanup on a dead engine never raises (request 0 may be the failed one)
    assert tp_llm.engine.abort(0) is False  # and after it nothing of request 0 is left
