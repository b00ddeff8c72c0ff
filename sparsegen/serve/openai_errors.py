"""OpenAI's error JSON, and the translation of bad input into a `RequestError` naming its field.

Every refusal is `{"error": {"message", "type", "param", "code"}}`; `param` is the field's path
in the body (`messages[0].role`), taken from pydantic's error location or from the message of a
`SamplingParams` check.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from .. import jsonio
from ..errors import RequestError, SparsegenError
from ..utf8 import lone_surrogate
from .protocol import _Strict

_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
_REQUEST_FIELD = re.compile(r"request\.(\w+)")


def error_json(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _field_names(*models: type[BaseModel]) -> set[str]:
    names, todo = set(), list(models)
    while todo:
        m = todo.pop()
        for name, f in m.model_fields.items():
            names.add(name)
            for arg in getattr(f.annotation, "__args__", ()) or ():
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
                for sub in getattr(arg, "__args__", ()) or ():
                    if isinstance(sub, type) and issubclass(sub, BaseModel):
                        todo.append(sub)
    return names


def request_fields() -> set[str]:
    """The field names of every request body model: `protocol._Strict` and its subclasses, those
    of the tokenize routes included (read when an error is made, so a route's own model counts)."""
    todo, models = [_Strict], []
    while todo:
        models.append(todo.pop())
        todo += models[-1].__subclasses__()
    return _field_names(*models)


def field_path(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; union-branch tags such as 'list[int]' stop it."""
    out = ""
    fields = request_fields()
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in fields:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def _children(path: str, value) -> list[tuple[str, object]]:
    """(path, item) of a JSON object's or array's members."""
    if isinstance(value, dict):
        return [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
    if isinstance(value, list):
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    return []


def surrogate_path(body: bytes) -> str | None:
    """The path (`messages[0].content`) of the first key or string of a JSON body that holds a
    lone surrogate escape (`"\\udcff"`), which pydantic refuses as invalid JSON; None if there is
    none or the body is not JSON to Python either."""
    try:
        data = jsonio.loads(body.decode("utf-8"), "body", ValueError)
    except (UnicodeDecodeError, ValueError):
        return None
    todo = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str) and lone_surrogate(value) is not None:
            return path or "body"
        if isinstance(value, dict) and any(lone_surrogate(k) is not None for k in value):
            return path or "body"  # a key: the path would hold the surrogate itself
        todo += reversed(_children(path, value))
    return None


def validation_error(exc: ValidationError, body: bytes = b"") -> RequestError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        where = surrogate_path(body) if "surrogate" in first["msg"] or "hex escape" in first["msg"] else None
        if where is not None:
            return RequestError(
                f"{where} holds a lone surrogate escape (half of a UTF-16 pair), which is not text", where
            )
        return RequestError(f"the body is not valid JSON: {first['msg']}", "body", "invalid_json")
    if first["type"] == "model_type":
        return RequestError("the body must be a JSON object", "body")
    loc = tuple(first["loc"])
    if first["type"] == "extra_forbidden":
        parent = field_path(loc[:-1])
        param = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
        return RequestError(f"unknown field {param!r}", param)
    param = field_path(loc)
    msg = first["msg"]
    if len(errors) > 1 and all(field_path(tuple(e["loc"])) == param for e in errors):
        msg = "; ".join(dict.fromkeys(e["msg"] for e in errors[:4]))
    return RequestError(f"{param or 'body'}: {msg}", param)


def sampling_error(exc: SparsegenError) -> RequestError:
    """A `SamplingParams` check's error as a 400 naming the field its message names."""
    m = _SAMPLING_FIELD.search(str(exc)) or _REQUEST_FIELD.search(str(exc))
    return RequestError(str(exc), m.group(1) if m else None)
