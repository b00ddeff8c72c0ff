"""One request's failure inside a step fails that request alone: the engine, `LLM` and the server
go on serving, its pages are freed, and a request beside it in the same batch finishes with the
tokens it would have had alone.

Requests are checked when they are made, so a failure inside a step is injected here: the
sampler's noise raises for the rows of seed `POISON` from their `AT`-th token on (a decode step,
after the prefill), and the server's text tracking raises for one request.
"""

from __future__ import annotations

import threading
import time

import pytest
from helpers import extras

from sparsegen.engine import LLMEngine
from sparsegen.errors import RequestFailedError
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.runner import sampling as sampling_mod

POISON, AT = 666, 2
GOOD = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
BAD = SamplingParams(max_tokens=12, temperature=1.0, seed=POISON, ignore_eos=True)


class Poisoned(RuntimeError):
    pass


@pytest.fixture
def poison(monkeypatch):
    """Makes the sampler fail for rows seeded POISON once they have AT tokens; returns the batch
    sizes of the calls that failed (so a test can check that a good row shared them)."""
    real = sampling_mod.seeded_exponentials
    batches: list[int] = []

    def noise(seeds, steps, vocab, device):
        if any(s == POISON and t >= AT for s, t in zip(seeds, steps, strict=True)):
            batches.append(len(seeds))
            raise Poisoned(f"seed {POISON} at step {max(steps)}")
        return real(seeds, steps, vocab, device)

    monkeypatch.setattr(sampling_mod, "seeded_exponentials", noise)
    return batches


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, num_pages=64, use_cuda_graphs=False, **kw)


def _idle_and_free(engine) -> bool:
    alloc = engine.cache.allocator
    return not engine.has_unfinished and alloc.num_free == alloc.capacity


@pytest.mark.parametrize("async_decode", [True, False])
def test_engine_fails_the_bad_request_alone(model, poison, async_decode):
    alone = _engine(model, async_decode=async_decode).generate([[7, 8, 9]], GOOD)[0].token_ids
    engine = _engine(model, async_decode=async_decode)
    good = engine.add_request([7, 8, 9], GOOD)
    bad = engine.add_request([1, 2, 3, 4], BAD)
    events = []
    for _ in range(100):
        if not engine.has_unfinished:
            break
        events += engine.step()
    assert poison and max(poison) == 2  # the bad row failed inside a batch of both
    errors = [e for e in events if e.error is not None]
    assert len(errors) == 1 and errors[0].request_id == bad.seq_id and errors[0].finish_reason == "error"
    assert isinstance(errors[0].error, RequestFailedError) and "Poisoned" in str(errors[0].error)
    assert bad.finish_reason == "error" and len(bad.output_ids) <= AT
    assert good.finish_reason == "length" and good.output_ids == alone
    assert _idle_and_free(engine)


def test_engine_generate_raises_the_error_and_the_engine_goes_on(model, poison):
    engine = _engine(model)
    with pytest.raises(RequestFailedError, match=f"Poisoned: seed {POISON}"):
        engine.generate([[7, 8, 9], [1, 2]], [GOOD, BAD])
    assert _idle_and_free(engine)
    (res,) = engine.generate([[7, 8, 9]], GOOD)
    assert len(res.token_ids) == GOOD.max_tokens


def test_engine_stream_raises_the_error(model, poison):
    engine = _engine(model)
    got = []
    with pytest.raises(RequestFailedError, match="Poisoned"):
        for event in engine.stream([[1, 2]], BAD):
            got.append(event.token_id)
    # the token in flight when the next step's sampler failed is dropped with the request
    assert AT - 1 <= len(got) <= AT and _idle_and_free(engine)


def test_the_failed_rows_cross_as_plain_text(poison):
    """`SamplerOutput.failed` is plain data: a tensor-parallel rank sends it as it is."""
    import pickle

    import torch

    from sparsegen.runner.isolation import sample_isolating

    logits = torch.randn(3, 32)
    params = [GOOD, BAD, SamplingParams(logprobs=2)]
    out = sample_isolating(
        logits, params, [[1, 2]] * 3, [[3]] * 3, eos_token_id=None, num_generated=[AT] * 3
    ).output()
    assert out.failed == ((1, f"Poisoned: seed {POISON} at step {AT}"),)
    assert pickle.loads(pickle.dumps(out)) == out
    assert out.token_ids[2] == int(logits[2].argmax()) and out.logprobs[2].token_id == out.token_ids[2]
    assert out.logprobs[0] is None and out.logprobs[1] is None


def test_rows_that_fail_only_together_fail_the_step(model, monkeypatch):
    """Not one request's fault (every row passes alone): the step raises, as before."""
    real = sampling_mod.seeded_exponentials

    def noise(seeds, steps, vocab, device):
        if len(seeds) > 1:
            raise Poisoned("a batch of two")
        return real(seeds, steps, vocab, device)

    monkeypatch.setattr(sampling_mod, "seeded_exponentials", noise)
    engine = _engine(model)
    with pytest.raises(Poisoned):
        engine.generate([[7, 8, 9], [1, 2]], [GOOD, GOOD])
    assert _idle_and_free(engine)


def test_llm_generate_raises_and_serves_on(poison):
    from sparsegen import LLM

    llm = LLM(random="tiny", max_num_seqs=4)
    with pytest.raises(RequestFailedError, match="Poisoned"):
        llm.generate(["hello", "world"], [GOOD, BAD], use_tqdm=False)
    assert _idle_and_free(llm.engine)
    out = llm.generate(["hello"], GOOD, use_tqdm=False)
    assert len(out[0].token_ids) == GOOD.max_tokens


# -- the server -------------------------------------------------------------------------------
httpx = extras.require("httpx")
extras.require("fastapi")


@pytest.fixture(scope="module")
def server():
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    with ServerThread(LLM(random="tiny", max_num_seqs=4), max_queue=8) as srv:
        yield srv


def _body(seed: int, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "random-tiny", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "stream": stream}  # fmt: skip


def _served_beside(server, bad_body: dict, stream: bool):
    """A long good request, and `bad_body` sent while the good one is decoding."""
    results = {}

    def good():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            results["good"] = c.post("/v1/completions", json=_body(5, 96, stream))

    t = threading.Thread(target=good)
    t.start()
    engine = server.app.state.engine.engine
    deadline = time.monotonic() + 30
    while not engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.001)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        results["bad"] = c.post("/v1/completions", json=bad_body)
        t.join(120)
        results["health"] = c.get("/health")
    return results


def _good_finished(r, stream: bool) -> None:
    assert r.status_code == 200, r.text
    if stream:
        assert '"finish_reason":"length"' in r.text.replace(" ", "") and "data: [DONE]" in r.text
        assert '"error"' not in r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 96


@pytest.mark.parametrize("stream", [False, True])
def test_server_fails_a_request_whose_step_fails_and_serves_the_other(server, poison, stream):
    from helpers.serve import all_pages_free

    res = _served_beside(server, _body(POISON, 8), stream)
    assert res["bad"].status_code == 500 and "Poisoned" in res["bad"].json()["error"]["message"]
    assert poison and max(poison) >= 2  # the bad row failed inside a batch with the good one
    _good_finished(res["good"], stream)
    assert res["health"].status_code == 200
    assert all_pages_free(server) and server.app.state.engine.alive


def test_server_survives_a_request_whose_text_tracking_fails(server, monkeypatch):
    from helpers.serve import all_pages_free

    from sparsegen.engine import outputs

    real = outputs.CompletionTracker.add

    def add(self, token_id, finish_reason, logprobs, *rest):
        if self.params.seed == POISON and len(self.token_ids) >= AT:
            raise Poisoned("cannot turn this token into text")
        return real(self, token_id, finish_reason, logprobs, *rest)

    monkeypatch.setattr(outputs.CompletionTracker, "add", add)
    res = _served_beside(server, _body(POISON, 8), stream=False)
    assert res["bad"].status_code == 500 and "Poisoned" in res["bad"].json()["error"]["message"]
    _good_finished(res["good"], stream=False)
    assert res["health"].status_code == 200
    assert all_pages_free(server) and server.app.state.engine.alive
