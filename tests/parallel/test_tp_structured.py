"""Constrained decoding over tensor parallelism (CPU, gloo, 2 ranks): the driver's grammar masks
travel in each step's message, every rank applies them where it samples, so json_schema requests
(sampled with a seed, and greedy) give JSON that validates and the same text as one process, in
one batch with a free row."""

from __future__ import annotations

import json

import pytest
from helpers import extras

from sparsegen import LLM
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.request.structured_outputs import StructuredOutputsParams as S

extras.require("llguidance")
jsonschema = extras.require("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["color", "n", "tags"],
    "additionalProperties": False,
}  # fmt: skip


def _params():
    json_rows = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                       structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
        for seed in (1, 2)
    ]  # fmt: skip
    greedy = SamplingParams(max_tokens=80, structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
    free = SamplingParams(max_tokens=6, ignore_eos=True)
    return [*json_rows, greedy, free]


def _texts(llm):
    params = _params()
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_json_schema_over_two_ranks_validates_and_equals_one_process():
    want = _texts(LLM(random="tiny", max_num_seqs=8))
    llm = LLM(random="tiny", max_num_seqs=8, tensor_parallel_size=2, device="cpu")
    try:
        got = _texts(llm)
    finally:
        llm.close()
    assert got == want
    for text, reason in got[:3]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
