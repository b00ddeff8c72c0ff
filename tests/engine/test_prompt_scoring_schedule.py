"""The scheduler's share for prompt_logprobs: the scored requests' chunks hold at most
SCORED_STEP_TOKENS tokens a step between them (each of their rows is a row of logits), plain
requests keep the rest of the budget, and the scores come out as with no cap."""

from __future__ import annotations

import pytest

from sparsegen.engine import scheduler
from sparsegen.engine.engine import LLMEngine
from sparsegen.models import random_model
from sparsegen.request.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [list(range(1 + i, 31 + i)) for i in range(4)]  # 30 tokens each
SCORED = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
PLAIN = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=0, attn_impl="reference")


def run(model, cap=None, monkeypatch=None):
    if cap is not None:
        monkeypatch.setattr(scheduler, "SCORED_STEP_TOKENS", cap)
    engine = LLMEngine(model, max_num_batched_tokens=64, max_num_seqs=4)
    plans = []
    launch = engine.executor.launch
    engine.executor.launch = lambda plan, *a: plans.append(plan) or launch(plan, *a)
    outs = engine.generate(PROMPTS, [SCORED, SCORED, PLAIN, SCORED])
    return outs, plans


def test_scored_rows_are_capped_per_step_and_scores_unchanged(model, monkeypatch):
    want, _ = run(model)
    got, plans = run(model, cap=10, monkeypatch=monkeypatch)
    prefills = [p for p in plans if not p.is_decode]
    for p in prefills:
        scored = sum(c.stop - c.start for c in p.chunks if c.seq.params.prompt_logprobs is not None)
        assert scored <= 10
    # the plain request is not held back by the cap: it runs in the first step, whole
    first = prefills[0]
    assert any(c.seq.params.prompt_logprobs is None and c.stop == 30 for c in first.chunks)
    assert len(prefills) >= 9  # 90 scored tokens, 10 a step
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
