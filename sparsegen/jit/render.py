"""Render kernel source from the Jinja templates in `templates/`.

Templates substitute typed constants only: every value that reaches a template is checked
to be an int, a bool, a known dtype name or a known enum word (or a list/tuple/dict of
those), never a free string from a config file. Rendering uses StrictUndefined, so a
missing constant is an error, not an empty string.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from ..errors import CompileError, RenderLimitError

# The most characters one render may produce. The largest kernels sparsegen renders today are
# the presets' CUDA decode kernels (about 33,000 characters); a legal spec at the edge (1,024
# query heads, each with its own pattern) renders about 430,000. Anything past this bound is a
# runaway template or spec, refused before it reaches a compiler.
RENDER_BUDGET = 2_000_000

# Words a template may receive as strings: dtype names, C types, pattern kinds, kernel names.
ALLOWED_WORDS = frozenset(
    {
        "fp16", "bf16", "fp32",
        "float16", "bfloat16", "float32",
        "half", "__half", "__nv_bfloat16", "float",
        "dense", "local", "vert", "window",
        "local+vert", "local+window", "vert+window", "local+vert+window",
        "local+sink", "local+vert+sink", "window+sink", "local+window+sink", "vert+window+sink",
        "local+vert+window+sink",
        "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120",
        "sparsegen_paged_decode", "sparsegen_paged_decode_reduce",  # fixed kernel names from Python
    }
)  # fmt: skip


def templates_dir() -> Path:
    """`sparsegen/templates` inside an installed wheel, else `templates/` of the source tree."""
    package = Path(__file__).resolve().parents[1]  # .../sparsegen (this file is sparsegen/jit/render.py)
    for candidate in (package / "templates", package.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise CompileError(
        f"sparsegen's templates are missing (looked in {package / 'templates'} and {package.parent / 'templates'})"
    )


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _read_template(name: str) -> bytes:
    path = templates_dir() / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CompileError(f"cannot read template {path}: {exc}") from None


def template_bytes(name: str) -> bytes:
    """The template's exact bytes, followed by those of every template it includes, recursively
    (all of them enter the cache key, so editing an included part invalidates the kernels)."""
    out, seen, todo = [], set(), [name]
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        data = _read_template(current)
        out.append(data if current == name else b"\0" + current.encode() + b"\0" + data)
        try:
            tree = _environment().parse(data.decode())
        except (UnicodeDecodeError, jinja2.TemplateSyntaxError) as exc:
            raise CompileError(f"template {current} cannot be parsed: {exc}") from None
        todo.extend(sorted(n for n in jinja2.meta.find_referenced_templates(tree) if n))
    return b"".join(out)


def check_constant(name: str, value: Any) -> None:
    """Raise CompileError unless `value` is a typed constant a template may receive."""
    if isinstance(value, bool) or isinstance(value, int):
        return
    if isinstance(value, str):
        if value not in ALLOWED_WORDS:
            raise CompileError(f"template constant {name} = {value!r} is not an allowed word")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_constant(f"{name}[{i}]", item)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str) or not k.isidentifier():
                raise CompileError(f"template constant {name} has a non-identifier key {k!r}")
            check_constant(f"{name}.{k}", item)
        return
    raise CompileError(f"template constant {name} has unsupported type {type(value).__name__}: {value!r}")


def render(template: str, **constants: Any) -> str:
    """Render `templates/<template>` with validated constants; RenderLimitError as soon as the
    output passes RENDER_BUDGET characters (rendering streams, so a runaway never fills memory)."""
    for name, value in constants.items():
        check_constant(name, value)
    limit = RENDER_BUDGET
    parts: list[str] = []
    total = 0
    try:
        for part in _environment().get_template(template).generate(**constants):
            total += len(part)
            if total > limit:
                raise RenderLimitError(
                    f"rendering {template} produced more than {limit:,} characters (the render budget; the "
                    f"largest real kernels are about 33,000): refused before compiling",
                    template=template,
                    limit=limit,
                )
            parts.append(part)
    except jinja2.TemplateError as exc:
        raise CompileError(f"rendering {template} failed: {exc}") from None
    return "".join(parts)
