"""The step messages of tensor parallelism (parallel.steps), without processes: a loopback executor
encodes every plan as the driver does, pickles it as a queue would, and runs it the way a rank
does (parallel.rank.RankSteps over this process's ModelRunner, from the rank's copies of the
sequences). Tokens must equal the plain engine's through chunked prefills, lookahead decode
steps, preemptions (whole block tables re-sent), aborts and seeded sampling with penalties."""

from __future__ import annotations

import json
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model
from sparsegen.parallel.rank import RankSteps
from sparsegen.parallel.steps import StepEncoder
from sparsegen.runner.inflight import InFlight

pytestmark = pytest.mark.usefixtures("single_thread")

# 11 usable pages of 16 tokens: four requests of up to 62 tokens cannot all hold theirs at once,
# so decode steps preempt (and re-admit) sequences
ENGINE = dict(num_pages=12, page_size=16, max_num_seqs=4, max_num_batched_tokens=24)
ROOMY = dict(ENGINE, num_pages=64)  # no preemption: decode steps are launched ahead
PROMPTS = [list(range(1, 21)), [5, 6, 7], [(3 * i) % 200 for i in range(30)], [9] * 12]
PARAMS = [
    SamplingParams(max_tokens=40, ignore_eos=True),
    SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, top_k=20, seed=11),
    SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=5, repetition_penalty=1.3),
    SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2),
]


class LoopbackExecutor:
    """MultiprocExecutor's driver side and one rank's side in one process."""

    def __init__(self, runner):
        self.cache = runner.cache
        self.encoder, self.rank = StepEncoder(), RankSteps(runner, rank=0)
        self.launched, self.whole_tables, self.lookaheads = 0, 0, 0

    def launch(self, plan, after, eos_token_id):
        msg = self.encoder.encode(plan, eos_token_id)
        self.whole_tables += sum(1 for u in msg[3] if u[3] and u[4] is None)  # a known sequence's new table
        self.lookaheads += plan.lookahead
        self.rank.launch(pickle.loads(ForkingPickler.dumps(msg)))
        copy = self.rank.last.plan
        assert [(c.seq.seq_id, c.start, c.stop) for c in copy.chunks] == [
            (c.seq.seq_id, c.start, c.stop) for c in plan.chunks
        ]
        for mine, theirs in zip(plan.chunks, copy.chunks, strict=True):
            a, b = mine.seq, theirs.seq
            assert (a.prompt_ids, a.output_ids, a.pages, a.params) == (
                b.prompt_ids,
                b.output_ids,
                b.pages,
                b.params,
            )
        step, self.launched = self.launched, self.launched + 1
        return InFlight(plan, None, _Collect(self.rank, step) if plan.sampled else None)

    def close(self, kill=False):
        pass


class _Collect:
    def __init__(self, rank, step):
        self.rank, self.step = rank, step

    def output(self):
        return self.rank.collect(self.step)


@pytest.fixture(scope="module")
def model():
    return random_model("tiny", seed=2)


def run(engine, params, abort_after: int | None = None):
    seqs = engine.submit(PROMPTS, params)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if steps == abort_after:
            assert engine.abort(seqs[3].seq_id)
    return [(s.output_ids, s.finish_reason) for s in seqs]


NO_PENALTY = [PARAMS[0], PARAMS[1], SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=5),
              PARAMS[3]]  # fmt: skip


@pytest.mark.parametrize(
    "kw, params, abort_after, sent",
    [(ENGINE, PARAMS, None, "whole_tables"), (ENGINE, PARAMS, 30, "whole_tables"),
     (ROOMY, NO_PENALTY, None, "lookaheads"), (ROOMY, NO_PENALTY, 9, "lookaheads")],
)  # fmt: skip
def test_rank_copies_give_the_plain_engines_tokens(model, kw, params, abort_after, sent):
    want = run(LLMEngine(model, **kw), params, abort_after)
    engine = LLMEngine(model, **kw)
    loop = engine.executor = LoopbackExecutor(engine.runner)
    got = run(engine, params, abort_after)
    assert got == want
    assert getattr(loop, sent) > 0  # preemptions re-sent block tables / decode steps went ahead
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
    assert not loop.rank.launched  # every step rank 0 launched was collected


def test_ended_sequences_are_forgotten_by_the_ranks(model):
    engine = LLMEngine(model, **ENGINE)
    loop = engine.executor = LoopbackExecutor(engine.runner)
    engine.generate(PROMPTS[:2], PARAMS[:2])
    assert set(loop.rank.seqs.seqs) <= {0, 1}
    engine.generate([[4, 4, 4]], SamplingParams(max_tokens=3, ignore_eos=True))  # the next message forgets
    assert set(loop.rank.seqs.seqs) == {2}


def test_grammar_masks_travel_with_the_step():
    """A json_schema row's masks ride in the step message (pickled as a queue would): the rank's
    copy of the plan carries them, and the text equals the plain engine's."""
    from helpers import extras

    from sparsegen import LLM
    from sparsegen.request.structured_outputs import StructuredOutputsParams

    extras.require("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    # two constrained rows and a free one that outlives them (its last steps carry no mask)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
              for s in (1, 2)] + [SamplingParams(max_tokens=40, ignore_eos=True)]  # fmt: skip

    def texts(llm):
        return [o.outputs[0].text for o in llm.generate(["JSON:"] * 3, params, use_tqdm=False)]

    want = texts(LLM(random="tiny"))
    llm = LLM(random="tiny")
    loop = llm.engine.executor = LoopbackExecutor(llm.engine.runner)
    masked = []
    launch = loop.rank.launch
    loop.rank.launch = lambda msg: (launch(msg), masked.append(loop.rank.last.plan.token_bitmask is not None))
    assert texts(llm) == want
    assert any(masked) and not all(masked)  # masked steps, and unmasked ones once only the free row is left
    assert all(isinstance(json.loads(t)["ok"], bool) for t in want[:2])
