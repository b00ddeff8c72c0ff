"""A request's output constraint: OpenAI's `response_format`, or vLLM's extras for it.

- `response_format`: `{"type": "text"}` (the default: no constraint), `{"type": "json_object"}`
  (any JSON object), or `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ..., "description": ...}}` (JSON valid against the schema);
- vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`,
  `disable_any_whitespace`, `whitespace_pattern`) and its older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar` fields.

At most one of them may constrain a request. A malformed one is a 400 naming its field; whether
the schema compiles is checked next, with the model's tokenizer (`LLM.check_params`), and a
schema that does not is a 400 naming the same field, before anything is queued.
"""

from __future__ import annotations

from ..errors import InputError, RequestError
from ..request.structured_outputs import StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _from_response_format(rf: dict) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise RequestError(
            f"response_format has unknown fields: {', '.join(sorted(extra))}", "response_format"
        )
    if kind == "text":
        if "json_schema" in rf:
            raise RequestError("response_format of type 'text' takes no json_schema", "response_format")
        return None
    if kind == "json_object":
        if "json_schema" in rf:
            raise RequestError(
                "response_format of type 'json_object' takes no json_schema", "response_format"
            )
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r:.60}",
            "response_format.type",
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "response_format.json_schema must be an object with a schema", "response_format.json_schema"
        )
    extra = set(spec) - SCHEMA_KEYS
    if extra:
        raise RequestError(
            f"response_format.json_schema has unknown fields: {', '.join(sorted(extra))}",
            "response_format.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise RequestError("response_format.json_schema.name must be a string of 1..64 characters",
                           "response_format.json_schema.name")  # fmt: skip
    for key, kinds in (("strict", (bool, type(None))), ("description", (str, type(None)))):
        if not isinstance(spec.get(key), kinds):
            raise RequestError(
                f"response_format.json_schema.{key} has the wrong type", f"response_format.json_schema.{key}"
            )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                           "response_format.json_schema.schema")  # fmt: skip
    return StructuredOutputsParams(json=schema)


def _from_fields(req) -> tuple[StructuredOutputsParams | None, str] | None:
    """(the constraint, the field that gave it) of whichever field is set; None if none is; a
    400 if two are."""
    given = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type") != "text":
        given.append("response_format")
    if getattr(req, "structured_outputs", None) is not None:
        given.append("structured_outputs")
    given += [name for name in GUIDED if getattr(req, name, None) is not None]
    if len(given) > 1:
        raise RequestError(f"give one output constraint, not {' and '.join(given)}", given[1])
    if rf is not None and not given:
        return _from_response_format(rf), "response_format"  # "text" (checked)
    if not given:
        return None
    field = given[0]
    try:
        if field == "response_format":
            return _from_response_format(rf), field
        if field == "structured_outputs":
            so = req.structured_outputs
            unknown = set(so) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise RequestError(
                    f"structured_outputs has unknown fields: {', '.join(sorted(unknown))}", field
                )
            return StructuredOutputsParams(**so), field
        return StructuredOutputsParams(**{GUIDED[field]: getattr(req, field)}), field
    except RequestError:
        raise
    except InputError as exc:
        raise RequestError(str(exc), field) from None


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The request's constraint (RequestError naming the field if it is malformed)."""
    found = _from_fields(req)
    return None if found is None else found[0]


def constraint_field(req) -> str | None:
    """The body field that constrains the request's output (for an error's `param`)."""
    found = _from_fields(req)
    return None if found is None or found[0] is None else found[1]
