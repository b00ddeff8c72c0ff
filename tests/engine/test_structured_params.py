"""`StructuredOutputsParams` and its place on `SamplingParams`: checked when made, hashable,
vLLM's older `guided_decoding` spelling folded into `structured_outputs`."""

from __future__ import annotations

import json

import pytest

from sparsegen.errors import InputError
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.request.structured_outputs import GuidedDecodingParams, StructuredOutputsParams


def test_each_kind_and_its_name():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = {
        "json": StructuredOutputsParams(json=schema),
        "json_object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex="[a-z]+"),
        "choice": StructuredOutputsParams(choice=["yes", "no"]),
        "grammar": StructuredOutputsParams(grammar='start: "a" | "b"'),
    }
    for kind, p in cases.items():
        assert p.kind == kind
        hash(p)
    # a dict schema is kept as its JSON text (order kept: it is the order of the output's keys)
    assert json.loads(cases["json"].json) == schema
    assert cases["choice"].choice == ("yes", "no")
    assert StructuredOutputsParams(json=json.dumps(schema)) == cases["json"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"json": "{not json"}, "not JSON text"),
        ({"json": "[1, 2]"}, "must be a JSON object"),
        ({"json": 5}, "must be a JSON schema"),
        ({"json": {"a": float("nan")}}, "not a JSON value"),
        ({"json": {"a": {1, 2}}}, "not a JSON value"),
        ({"json": "[" * 100_000 + "]" * 100_000}, "too deeply|not JSON"),
        ({"json": {"x": "a" * (1 << 20)}}, "at most"),
        ({"regex": ""}, "must not be empty"),
        ({"regex": b"a"}, "must be a str"),
        ({"regex": "\ud800"}, "surrogate|UTF-8|text"),
        ({"choice": "yes"}, "list of str"),
        ({"choice": []}, "1..4096"),
        ({"choice": ["a", ""]}, r"choice\[1\]"),
        ({"choice": ["a", 3]}, r"choice\[1\]"),
        ({"choice": ["x"] * 4097}, "1..4096"),
        ({"json_object": 1}, "json_object must be True"),
        ({"grammar": 7}, "must be a str"),
        ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
        ({"json_object": True, "whitespace_pattern": ""}, "whitespace_pattern"),
    ],
)
def test_bad_params_are_input_errors(kwargs, match):
    with pytest.raises(InputError, match=match):
        StructuredOutputsParams(**kwargs)


def test_a_deeply_nested_schema_dict_is_refused_not_a_crash():
    deep: dict = {}
    node = deep
    for _ in range(100_000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(InputError, match="too deeply"):
        StructuredOutputsParams(json=deep)


def test_sampling_params_take_either_spelling():
    so = StructuredOutputsParams(regex="[0-9]+")
    p = SamplingParams(structured_outputs=so)
    assert p.has_structured_output and p.structured_outputs is so and p.guided_decoding is None
    hash(p)
    gd = GuidedDecodingParams(choice=["a", "b"], backend="xgrammar")
    q = SamplingParams(guided_decoding=gd)
    assert q.structured_outputs is gd and q.has_structured_output
    r = SamplingParams(structured_outputs={"json_object": True})
    assert r.structured_outputs == StructuredOutputsParams(json_object=True)
    assert not SamplingParams().has_structured_output


def test_sampling_params_refuse_bad_structured_values():
    with pytest.raises(InputError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(InputError, match="unknown fields: jsn"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(InputError, match="disagree"):
        SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a"),
            guided_decoding=GuidedDecodingParams(regex="b"),
        )
    with pytest.raises(InputError, match="backend"):
        GuidedDecodingParams(regex="a", backend=3)
