"""Unknown request fields: dropped and logged once per field name, or (strict) a 400 naming them.

The request models refuse every field they do not declare (`protocol.py`). Unless the server is
strict, a body with such fields is validated again without them, the way vLLM
accepts fields it does not know; each field path (`stream_options.bogus`, `messages[].x`) is
logged at warning level the first time it is seen, not on every request.
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ValidationError

log = logging.getLogger("sparsegen")
MAX_PASSES = 4  # nested unknown fields surface one level per validation
MAX_LOGGED = 256  # names remembered; clients choose them, so the set is bounded


def _drop(data, loc: tuple) -> str | None:
    """Delete the key at pydantic location `loc` from the parsed body; its path with list indices
    written `[]`, or None when the location does not lead to a key (a union branch's tag)."""
    node, path = data, ""
    for part in loc[:-1]:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node, path = node[part], path + "[]"
        elif isinstance(node, dict) and isinstance(part, str) and part in node:
            node, path = node[part], f"{path}.{part}" if path else part
        # else: a union branch's tag (`list[int]`, `str`): the data has no level for it
    key = loc[-1]
    if not isinstance(node, dict) or key not in node:
        return None
    del node[key]
    return f"{path}.{key}" if path else str(key)


class UnknownFields:
    """Validates bodies for one app; remembers which unknown field names it has logged."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.logged: set[str] = set()  # a cache of what was announced, so the log is not flooded

    def validate(self, model: type[BaseModel], body: bytes) -> BaseModel:
        """The body as `model`; unless strict, without the unknown fields (so that another fault
        of the body is the one reported)."""
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            if self.strict or not _extras(exc):
                raise
            first = exc
        data = json.loads(body)  # it parsed as JSON: pydantic found fields in it
        for _ in range(MAX_PASSES):
            dropped = [_drop(data, tuple(e["loc"])) for e in _extras(first)]
            if None in dropped:
                raise first
            for name in dropped:
                if name not in self.logged and len(self.logged) < MAX_LOGGED:
                    self.logged.add(name)
                    log.warning("ignoring the unknown request field %r (--strict refuses it)", name[:80])
            try:
                return model.model_validate_json(json.dumps(data))
            except ValidationError as exc:
                if not _extras(exc):
                    raise
                first = exc
        raise first


def _extras(exc: ValidationError) -> list[dict]:
    return [e for e in exc.errors(include_url=False) if e["type"] == "extra_forbidden"]
