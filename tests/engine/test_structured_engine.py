"""Constrained decoding end to end on the random tiny model, whose outputs are random: the
grammar is what makes them JSON that validates, one of the choices, a match of the regex. Each
test runs its requests as one batch (constrained and free rows mixed, greedy and sampled)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import extras

from sparsegen.errors import InputError
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.request.structured_outputs import GuidedDecodingParams
from sparsegen.request.structured_outputs import StructuredOutputsParams as S

extras.require("llguidance")
jsonschema = extras.require("jsonschema")

SCHEMAS = {
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },  # fmt: skip
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 3,
    },
    "nested": {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"x": {"type": "string", "maxLength": 3}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },  # fmt: skip
}


@pytest.fixture(scope="module")
def llm(single_thread):
    from sparsegen import LLM

    return LLM(random="tiny", max_num_seqs=16)


def _run(llm, prompts, params):
    return [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_json_schemas_validate_across_seeds(llm):
    cases = [(name, seed) for name in SCHEMAS for seed in range(3)]
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                       structured_outputs=S(json=SCHEMAS[name], disable_any_whitespace=True))
        for name, seed in cases
    ]  # fmt: skip
    outs = _run(llm, ["Answer in JSON:"] * len(cases), params)
    for (name, seed), out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop", (name, seed, out.text)
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMAS[name])


@pytest.mark.slow
def test_choice_regex_json_object_and_free_rows_in_one_batch(llm):
    choices = ["yes", "no", "maybe so"]
    free = SamplingParams(max_tokens=6, ignore_eos=True)  # greedy
    params = [
        SamplingParams(max_tokens=20, structured_outputs=S(choice=choices)),  # greedy
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, guided_decoding=GuidedDecodingParams(choice=choices)),
        free,
        SamplingParams(max_tokens=20, temperature=1.0, seed=4, structured_outputs=S(regex=r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                       structured_outputs=S(json_object=True, disable_any_whitespace=True)),
    ]  # fmt: skip
    outs = _run(llm, ["q"] * len(params), params)
    assert outs[0].text in choices and outs[1].text in choices
    assert outs[0].finish_reason == outs[1].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[3].text), outs[3].text
    if outs[4].finish_reason == "stop":
        assert isinstance(json.loads(outs[4].text), dict)
    else:
        assert outs[4].text.startswith("{")
    # the free row is exactly what it is alone: the constrained rows change nothing of it
    assert outs[2].token_ids == _run(llm, ["q"], free)[0].token_ids


def test_max_tokens_cuts_a_json_output_short(llm):
    p = SamplingParams(max_tokens=3, structured_outputs=S(json=SCHEMAS["enums"]))
    (out,) = _run(llm, ["q"], p)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")  # a prefix of valid JSON, not complete (vLLM does the same)


def test_a_schema_that_does_not_compile_queues_nothing(llm):
    engine = llm.engine
    good = SamplingParams(structured_outputs=S(json_object=True))
    bad = SamplingParams(structured_outputs=S(json={"type": "integer", "minimum": 3, "maximum": 1}))
    with pytest.raises(InputError, match="prompt 1: structured_outputs.json does not compile: .*minimum"):
        engine.submit([[1, 2], [3, 4]], [good, bad])
    assert not engine.has_unfinished and len(engine.structured) == 0
    with pytest.raises(InputError, match="does not compile"):
        llm.check_params(bad)
    with pytest.raises(InputError, match="does not compile"):
        llm.generate(["x"], bad, use_tqdm=False)


def test_one_requests_grammar_failure_fails_it_alone(llm):
    engine = llm.engine
    # its allowed_token_ids leave nothing the grammar allows: the sampler fails that row only
    doomed = SamplingParams(max_tokens=4, structured_outputs=S(choice=["yes"]), allowed_token_ids=[ord("z")])
    fine = SamplingParams(max_tokens=4, structured_outputs=S(choice=["no"]))
    a, b = engine.submit([[5, 6], [7, 8]], [doomed, fine])
    events = []
    while engine.has_unfinished:
        events += engine.step()
    errors = [e for e in events if e.error is not None]
    assert [e.request_id for e in errors] == [a.seq_id]
    assert "allowed_token_ids and its grammar" in str(errors[0].error)
    mine = [e.token_id for e in events if e.request_id == b.seq_id]
    assert bytes(mine).decode() == "no" and b.finish_reason == "grammar"
    assert len(engine.structured) == 0
    alloc = engine.cache.allocator
    assert alloc.num_free == alloc.capacity  # every page back


@pytest.mark.slow
def test_preempted_constrained_requests_resume_their_grammar():
    """A sequence preempted for pages is recomputed with its output kept: its matcher's state
    still fits it, and its seeded output is the one an unpreempted run gives."""
    from sparsegen import LLM

    rx = "[a-z]{18}[0-9]{18}"
    params = [
        SamplingParams(max_tokens=50, temperature=1.0, seed=s, structured_outputs=S(regex=rx))
        for s in range(3)
    ]
    roomy = LLM(random="tiny", max_num_seqs=4)
    want = [r.outputs[0].token_ids for r in roomy.generate(["p"] * 3, params, use_tqdm=False)]
    # each request grows to 3 pages of 16 tokens: the three, admitted at once, outgrow 7 pages
    tight = LLM(random="tiny", max_num_seqs=4, num_pages=7)
    preempted = []
    real = tight.engine.scheduler._preempt
    tight.engine.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), real(seq))[1]
    outs = [r.outputs[0] for r in tight.generate(["p"] * 3, params, use_tqdm=False)]
    assert preempted, "the cache was meant to be too small for every request at once"
    assert [o.token_ids for o in outs] == want
    for out in outs:
        assert re.fullmatch(rx, out.text) and out.finish_reason == "stop"


def test_n_completions_and_chat_each_follow_the_grammar(llm):
    from sparsegen import GuidedDecodingParams

    choices = ["aa", "bb", "cc"]
    p = SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=choices)
    )
    (r,) = llm.generate(["x"], sampling_params=p, use_tqdm=False)
    assert len(r.outputs) == 3 and all(o.text in choices and o.finish_reason == "stop" for o in r.outputs)
    (c,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=10, structured_outputs=S(regex="[0-9]{4}")),
                    use_tqdm=False)  # fmt: skip
    assert re.fullmatch("[0-9]{4}", c.outputs[0].text)
