"""The one-step lookahead (`async_decode`, `runner.inflight`) against the synchronous engine (CPU).

On a CPU the lookahead runs the same code with synchronous copies: step n+1 is planned and run
from step n's sampled tokens (passed as a tensor) before step n's tokens are booked. Every test
runs the same calls on an engine with `async_decode=False` and one with it on, and checks the
tokens, the events, and the page accounting, and that lookahead steps really ran.
"""

from __future__ import annotations

import pytest
import torch
from helpers.graphs import stand_in_graphs

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.errors import InputError
from sparsegen.runner.sampling import sample, sample_on_device

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 23, 57, 9, 31)]


class PlanLog:
    """Records every plan an engine runs: (lookahead, seq_ids, start positions)."""

    def __init__(self, engine: LLMEngine):
        self.plans, self.dropped = [], 0  # dropped: rows read back for a sequence that had ended
        forward, complete = engine.runner.run, engine._complete

        def logged(plan):
            self.plans.append(
                (plan.lookahead, [c.seq.seq_id for c in plan.chunks], [c.start for c in plan.chunks])
            )
            return forward(plan)

        def counted(done):
            self.dropped += sum(s.finish_reason is not None for s in done.plan.sampled)
            return complete(done)

        engine.runner.run, engine._complete = logged, counted

    @property
    def lookahead(self) -> int:
        return sum(la for la, _, _ in self.plans)


def check_pages(engine: LLMEngine) -> None:
    """Every page is free (empty or cached) or referenced once per running sequence holding it."""
    alloc = engine.cache.allocator
    alloc.check([s.pages for s in engine.scheduler.running])
    assert not any(s.pages for s in engine.scheduler.waiting)


def drive(engine: LLMEngine, prompts, params, *, actions=None) -> list:
    """Submit, then step to the end, checking the pages after every call; `actions[k]` runs
    before call k (aborts, new requests). Returns every event in order."""
    engine.submit(prompts, params)
    events, k = [], 0
    actions = dict(actions or {})
    while engine.has_unfinished or actions:
        if k in actions:
            actions.pop(k)(engine)
        events += engine.step()
        check_pages(engine)
        k += 1
        assert k < 500
    alloc = engine.cache.allocator
    assert alloc.num_free == alloc.capacity
    return events


def per_request(events) -> dict[int, tuple[list[int], list]]:
    out: dict[int, tuple[list[int], list]] = {}
    for e in events:
        toks, reasons = out.setdefault(e.index, ([], []))
        toks.append(e.token_id)
        reasons.append(e.finish_reason)
    return out


def pair(model, **kw) -> tuple[LLMEngine, LLMEngine, PlanLog]:
    sync = LLMEngine(model, async_decode=False, **kw)
    fast = LLMEngine(model, **kw)
    assert fast.config.async_decode  # the default
    return sync, fast, PlanLog(fast)


def test_lockstep_the_caller_sees_the_same_engine_after_every_call(model, prompts):
    """Both engines stepped call by call: each call returns the same events, and afterwards
    `has_unfinished`, every sequence's tokens and finish reason are the same (the async engine
    has only launched its next step). The synchronous engine never plans a lookahead step."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True, seed=n, temperature=0.5) for n in (6, 11, 3, 8)]
    sync, fast, log = pair(model, max_num_seqs=3)
    sync_log = PlanLog(sync)
    a, b = sync.submit(prompts[:4], params), fast.submit(prompts[:4], params)
    calls = 0
    while sync.has_unfinished or fast.has_unfinished:
        assert sync.step() == fast.step()
        assert sync.has_unfinished == fast.has_unfinished
        assert [(s.output_ids, s.finish_reason) for s in a] == [(s.output_ids, s.finish_reason) for s in b]
        calls += 1
    assert calls == len(sync_log.plans) and log.lookahead >= 5 and sync_log.lookahead == 0


def test_greedy_seeded_logprobs_and_min_tokens_equal_the_sync_engine(model, prompts):
    """Finishes by length only (known ahead): the plans match one to one, so the event lists are
    equal to the last logprob; a waiting request joins when a seat frees."""
    params = [
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=7, min_tokens=5, stop_token_ids=(3, 4), logprobs=0),
        SamplingParams(max_tokens=10, temperature=1.1, top_p=0.9, min_p=0.05, seed=3, ignore_eos=True),
    ]
    sync, fast, log = pair(model, max_num_seqs=3)
    want = drive(sync, prompts[:4], params)
    got = drive(fast, prompts[:4], params)
    assert got == want
    assert log.lookahead >= 10


def test_finishes_on_token_values_while_others_continue(model, prompts):
    """Stop tokens, EOS at the first token, max_tokens=1 and waiting requests: a sequence that
    ends on its token's value was also run in the lookahead step, whose extra token is dropped."""
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    base = {
        i: toks
        for i, (toks, _) in per_request(drive(LLMEngine(model, async_decode=False), prompts, plain)).items()
    }

    def first_new_at_or_after(toks, at):  # the index of a token not seen before it
        return next(k for k in range(at, len(toks)) if toks[k] not in toks[:k])

    stop3, stop4 = first_new_at_or_after(base[3], 1), first_new_at_or_after(base[4], 3)
    params = [
        plain,
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=10),  # EOS = its first token
        SamplingParams(max_tokens=10, stop_token_ids=(base[3][stop3],), ignore_eos=True),
        SamplingParams(max_tokens=10, stop_token_ids=(base[4][stop4],), ignore_eos=True),
    ]
    sync, fast, log = pair(model, max_num_seqs=3)
    sync.eos_token_id = fast.eos_token_id = base[2][0]
    want = per_request(drive(sync, prompts, params))
    got = per_request(drive(fast, prompts, params))
    assert got == want
    assert got[0] == (base[0], [None] * 9 + ["length"])
    assert got[1] == (base[1][:1], ["length"])
    assert got[2] == (base[2][:1], ["eos"])
    assert got[3] == (base[3][: stop3 + 1], [None] * stop3 + ["stop"])
    assert got[4] == (base[4][: stop4 + 1], [None] * stop4 + ["stop"])
    assert log.lookahead and log.dropped >= 2  # each stop token's sequence ran one more step, dropped


def test_penalties_run_synchronously_and_match(model, prompts):
    """A row with penalties needs its previous token on the host: no lookahead step holds it, and
    lookahead resumes once it has finished."""
    pen = SamplingParams(max_tokens=5, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True)
    params = [
        pen,
        SamplingParams(max_tokens=14, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True),
    ]
    sync, fast, log = pair(model)
    want = drive(sync, prompts[:3], params)
    got = drive(fast, prompts[:3], params)
    assert got == want
    pen_ids = {0}  # seq ids are per engine: request 0 is seq 0
    assert all(not (set(ids) & pen_ids) for la, ids, _ in log.plans if la)
    assert log.lookahead >= 5


def test_abort_while_a_step_is_in_flight(model, prompts):
    """Abort a request whose lookahead step is in flight: it emits nothing more, its pages
    (including the page grown for the step in flight) are back, and the others are exact."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def abort_second(engine):
        if engine.config.async_decode:
            assert engine._inflight is not None and engine._inflight.plan.lookahead
            assert 1 in [c.seq.seq_id for c in engine._inflight.plan.chunks]
        assert engine.abort(1) and not engine.abort(1)

    sync, fast, log = pair(model, page_size=8)
    want = drive(sync, prompts[:3], params, actions={4: abort_second})
    got = drive(fast, prompts[:3], params, actions={4: abort_second})
    assert got == want
    assert len(per_request(got)[1][0]) == 4  # the prefill's token + three decode steps before call 4
    assert log.lookahead


def test_aborting_everything_mid_flight_then_a_new_request(model, prompts):
    """A stream closed mid-decode aborts its requests with a step in flight; that step is
    dropped on the next call and a new request gives the tokens of a fresh engine."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = LLMEngine(model, async_decode=False).generate([prompts[2]], params)[0].token_ids
    engine = LLMEngine(model)
    it = engine.stream(prompts[:2], params)
    first = [next(it) for _ in range(6)]
    assert engine._inflight is not None
    it.close()
    assert len(first) == 6 and not engine.has_unfinished
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
    assert engine.generate([prompts[2]], params)[0].token_ids == want
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


def test_new_requests_arriving_mid_decode(model, prompts):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (16, 11)]
    late = SamplingParams(max_tokens=8, ignore_eos=True)
    actions = {
        3: lambda e: e.add_request(prompts[2], late, index=7),
        9: lambda e: e.add_request(prompts[3], late, index=8),
        10: lambda e: e.add_request(prompts[4], SamplingParams(max_tokens=1), index=9),
    }
    sync, fast, log = pair(model, max_num_seqs=4)
    want = per_request(drive(sync, prompts[:2], params, actions=dict(actions)))
    got = per_request(drive(fast, prompts[:2], params, actions=dict(actions)))
    assert got == want and set(got) == {0, 1, 7, 8, 9}
    alone = LLMEngine(model, async_decode=False).generate([prompts[3]], late)[0].token_ids
    assert got[8][0] == alone
    assert log.lookahead >= 8


def test_a_failed_lookahead_step_is_dropped_and_the_engine_goes_on(model, prompts):
    """The forward pass of a lookahead step raises once; a caller that keeps stepping (as the
    server does for other requests) gets exactly the tokens of an engine that never failed."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = per_request(drive(LLMEngine(model, async_decode=False), prompts[:2], params))
    engine = LLMEngine(model)
    forward, failed = engine.runner.run, []

    def flaky(plan):
        if plan.lookahead and not failed:
            failed.append(plan)
            raise RuntimeError("boom")
        return forward(plan)

    engine.runner.run = flaky
    engine.submit(prompts[:2], params)
    events = []
    while engine.has_unfinished:
        try:
            events += engine.step()
        except RuntimeError:
            assert engine._inflight is None
        check_pages(engine)
    assert failed and per_request(events) == want
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


def test_max_model_len_is_never_passed_by_a_lookahead_step(model, prompts):
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    sync, fast, log = pair(model, max_model_len=60, page_size=8)
    want = per_request(drive(sync, [prompts[0], prompts[3]], params))
    got = per_request(drive(fast, [prompts[0], prompts[3]], params))
    assert got == want and [len(t) for t, _ in got.values()] == [20, 51]
    assert max(max(starts) for _, _, starts in log.plans) == 58 and log.lookahead


def test_graph_stand_in_takes_the_device_ids(model, prompts):
    """Lookahead steps through `DecodeGraphs.run` (static buffers, a CPU stand-in for the graph):
    the input ids come from the previous step's token tensor, copied into the static ids."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = per_request(drive(LLMEngine(model, async_decode=False, max_num_seqs=4), prompts[:3], params))
    engine = LLMEngine(model, max_num_seqs=4)
    graphs = stand_in_graphs(model, engine, 4)
    seen_ids = []
    run = graphs.run

    def logged_run(inputs, input_ids=None):
        seen_ids.append(input_ids is not None)
        return run(inputs, input_ids)

    graphs.run = logged_run
    got = per_request(drive(engine, prompts[:3], params))
    assert got == want and sum(seen_ids) >= 6


def test_sample_on_device_counts_and_refusals():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=11, min_tokens=4, stop_token_ids=(7,))
    ahead = sample_on_device(logits, [seeded] * 2, [[1, 2], [3]], num_generated=[3, 2]).output()
    assert ahead == sample(logits, [seeded] * 2, [[1, 2, 9], [3, 9]])
    pen = SamplingParams(repetition_penalty=1.2)
    with pytest.raises(InputError, match="penalties"):
        sample_on_device(logits[:1], [pen], [[1]], num_generated=[2])
    with pytest.raises(InputError, match="num_generated"):
        sample_on_device(logits, [seeded] * 2, [[], []], num_generated=[0])


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_async_decode_must_be_a_bool(model, value):
    with pytest.raises(InputError, match="async_decode"):
        LLMEngine(model, async_decode=value)
