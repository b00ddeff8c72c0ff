"""Over two tensor-parallel ranks (gloo, CPU): a request the batched step cannot hold is refused
before any rank runs it, and one whose sampling fails inside a step (injected on every rank)
fails alone. The ranks live, /health stays 200, and a request beside it finishes."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import extras

httpx = extras.require("httpx")
extras.require("fastapi")

from sparsegen import LLM  # noqa: E402
from sparsegen.serve.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
POISON = 666


def _poison(ctx, seed: int) -> bool:
    """On a rank: the sampler's noise raises for rows seeded `seed` after their first token."""
    from sparsegen.runner import sampling

    real = getattr(sampling, "_real_noise", sampling.seeded_exponentials)
    sampling._real_noise = real

    def noise(seeds, steps, vocab, device):
        if any(s == seed and t >= 1 for s, t in zip(seeds, steps, strict=True)):
            raise RuntimeError(f"poisoned seed {seed}")
        return real(seeds, steps, vocab, device)

    sampling.seeded_exponentials = noise
    return True


def _cure(ctx) -> bool:
    from sparsegen.runner import sampling

    sampling.seeded_exponentials = getattr(sampling, "_real_noise", sampling.seeded_exponentials)
    return True


@pytest.fixture(scope="module")
def server(single_thread):  # noqa: F811
    llm = LLM(random="tiny", device="cpu", tensor_parallel_size=2, max_num_seqs=4)
    try:
        with ServerThread(llm, max_queue=8) as srv:
            yield srv
    finally:
        llm.engine.close()


def _body(seed: int, max_tokens: int) -> dict:
    return {"model": "random-tiny", "prompt": "hello", "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "ignore_eos": True}  # fmt: skip


def test_tp_refuses_what_the_step_cannot_hold(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/completions", json={**_body(1, 2), "top_k": 2**70})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=_body(1, 2)).status_code == 200


def test_tp_fails_the_poisoned_request_alone(server):
    engine = server.app.state.engine.engine
    engine.executor.call(_poison, POISON)  # from this thread while the engine is idle (no request in flight)
    try:
        got = {}

        def good():
            with httpx.Client(base_url=server.url, timeout=120) as c:
                got["good"] = c.post("/v1/completions", json=_body(5, 48))

        t = threading.Thread(target=good)
        t.start()
        deadline = time.monotonic() + 60
        while not engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.005)
        with httpx.Client(base_url=server.url, timeout=120) as c:
            bad = c.post("/v1/completions", json=_body(POISON, 8))
            t.join(120)
            health = c.get("/health")
        assert bad.status_code == 500 and "poisoned seed" in bad.json()["error"]["message"], bad.text
        assert got["good"].status_code == 200, got["good"].text
        assert got["good"].json()["usage"]["completion_tokens"] == 48
        assert health.status_code == 200 and server.app.state.engine.alive
    finally:
        engine.executor.call(_cure)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.post("/v1/completions", json=_body(POISON, 4)).status_code == 200
