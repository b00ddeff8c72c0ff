"""`response_format` and vLLM's structured-output fields through the official openai client:
JSON that parses and validates against the schema, choices and regexes, and 400s naming the
field for malformed or uncompilable constraints, before anything is queued."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import extras
from helpers.serve import MODEL, all_pages_free

openai = extras.require("openai")
extras.require("llguidance")
jsonschema = extras.require("jsonschema")

PERSON = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _fmt(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json please"}], **kw
    )


@pytest.mark.slow
def test_json_schema_responses_parse_and_validate(client, server):
    cases = [(schema, seed) for schema in (PERSON, TAGS) for seed in range(2)]
    with ThreadPoolExecutor(len(cases)) as pool:  # one batch in the engine
        replies = list(pool.map(lambda c: _chat(client, response_format=_fmt(c[0]), seed=c[1],
                                                temperature=1.0, max_tokens=200), cases))  # fmt: skip
    for (schema, seed), r in zip(cases, replies, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert all_pages_free(server)


@pytest.mark.slow
def test_json_object_and_vllm_fields_on_both_endpoints(client):
    r = _chat(client, response_format={"type": "json_object"}, max_tokens=60, temperature=1.0, seed=2)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    c = client.completions.create(
        model=MODEL, prompt="pick", max_tokens=10, extra_body={"guided_choice": ["left", "right"]}
    )
    assert c.choices[0].text in ("left", "right") and c.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL, prompt="code", max_tokens=12, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})  # fmt: skip
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", c.choices[0].text)
    c = client.completions.create(
        model=MODEL, prompt="p", max_tokens=40, temperature=1.0, seed=3,
        extra_body={"response_format": _fmt(PERSON), "structured_outputs": None},
    )  # fmt: skip
    if c.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(c.choices[0].text), PERSON)


def test_text_is_the_default_and_a_cut_off_is_length(client):
    r = _chat(client, response_format={"type": "text"}, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    r = _chat(client, response_format=_fmt(PERSON), max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def _deep(n: int) -> dict:
    node: dict = {"type": "integer"}
    for _ in range(n):
        node = {"type": "object", "properties": {"a": node}}
    return node


@pytest.mark.parametrize(
    "body,param,match",
    [
        ({"response_format": _fmt({"type": "nope"})}, "response_format", "does not compile"),
        (
            {"response_format": _fmt({"type": "integer", "minimum": 2, "maximum": 1})},
            "response_format",
            "minimum",
        ),
        ({"response_format": _fmt(_deep(70))}, "response_format", "recursion"),
        (
            {
                "response_format": _fmt(
                    {
                        "type": "object",
                        "properties": {f"p{i}": {"enum": list(map(str, range(20)))} for i in range(5000)},
                    }
                )
            },
            "response_format",
            "too (big|large)",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.schema",
            "JSON schema object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {}, "extra": 1},
                }
            },
            "response_format.json_schema",
            "unknown fields: extra",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
        (
            {"response_format": {"type": "json_object", "bogus": 1}},
            "response_format",
            "unknown fields: bogus",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "give one"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
        ({"guided_choice": []}, "guided_choice", "1..4096"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown fields: jsn"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_bad_constraints_are_400_naming_the_field(client, server, body, param, match):
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, max_tokens=4, extra_body=body)
    err = info.value.response.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err
    assert time.perf_counter() - start < 30  # compiled in bounded time, never a hang
    assert all_pages_free(server)


def test_a_streamed_choice_arrives_whole(client, server):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "pick"}],
        max_tokens=10,
        stream=True,
        extra_body={"guided_choice": ["north", "south"]},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in ("north", "south")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all_pages_free(server)
