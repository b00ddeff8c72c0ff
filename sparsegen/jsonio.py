"""Reading JSON that someone else wrote (spec files, config.json, checkpoint indexes), bounded.

`json.loads` recurses once per nesting level, so a file nested 100,000 deep raises
`RecursionError`; it also accepts duplicate keys (the last one silently wins) and raises a bare
`ValueError` for an integer of more than 4300 digits. `loads` measures the nesting depth first,
without recursing, and turns every such case into the caller's error class, naming the source.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64  # deepest nesting accepted; a spec file needs 5, HF configs fewer than 10
MAX_JSON_BYTES = 64 << 20  # the largest file read; specs and configs are a few MB at most

_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting outside strings, computed without recursion.

    Escapes are removed first (an escaped backslash, then an escaped quote), so that what is left
    of every string is a plain `"..."` run without inner quotes, which one regex drops.
    """
    bare = _STRING.sub("", text.replace("\\\\", "").replace('\\"', ""))
    brackets = _NOT_BRACKET.sub("", bare)
    return max(itertools.accumulate(_STEP[c] for c in brackets), default=0)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice in one JSON object")
        obj[key] = value
    return obj


def loads(text: str, source: str, error: type[Exception]) -> Any:
    """Parse JSON text; anything wrong raises `error` with a message that starts with `source`."""
    if not isinstance(text, str):
        raise error(f"{source}: JSON text must be a str, got {type(text).__name__}")
    depth = nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{source}: JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    try:
        return json.loads(text, object_pairs_hook=_unique_object)
    except json.JSONDecodeError as exc:
        raise error(f"cannot read {source}: not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # a duplicate key, an int of more than 4300 digits
        raise error(f"cannot read {source}: not usable JSON: {exc}") from None


def read_json_file(path: str | Path, error: type[Exception]) -> Any:
    """Read and parse one JSON file (at most MAX_JSON_BYTES); errors name the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise error(f"{path} is {size} bytes; a JSON file of at most {MAX_JSON_BYTES} bytes is expected")
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from None
    return loads(text, str(path), error)
