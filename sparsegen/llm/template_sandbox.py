"""A bounded sandbox for Jinja templates that come with a checkpoint (chat templates).

jinja2's `ImmutableSandboxedEnvironment` keeps a template from reaching Python internals or
changing what it is given, but not from exhausting the process. `BoundedSandbox` also bounds:
- what a template builds: `*`, `+` and `~` refuse results over `MAX_CHARS` characters (a list
  counts its items and the characters of its strings) before computing them; `**` refuses
  numbers of more than 4096 bits; `replace`, and `join` (the filter and the str method), refuse
  results over MAX_CHARS before building them;
- calls (str methods, `range`, filters): int arguments, and the widths of `%` and `format`
  strings, are at most `MAX_INT_ARG` (`'x'.center(10**10)`, `range(10**9)`, `'%9999999999d'`);
  `lipsum` is gone;
- its work: at most `MAX_STEPS` lines of template code run in one render;
- its output: at most `MAX_CHARS` characters.
`render_bounded` turns every failure (these limits, `{{ 1/0 }}`, an undefined attribute,
recursion) into the caller's error naming the template.
"""

from __future__ import annotations

import operator
import re
import sys
from collections.abc import Callable

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import TemplateLimitError

MAX_CHARS = 16 << 20  # the most characters (or items) a template may build or output
MAX_INT_ARG = 100_000  # the largest int a template may pass to a call (widths, counts, ranges)
MAX_STEPS = 2_000_000  # lines of template code one render may run
MAX_POW_BITS = 4096
TEMPLATE_FILE = "<template>"  # the file name jinja gives the code of `from_string` templates
_DIGITS = re.compile(r"\d+")


def _weight(value) -> int:
    """Characters of a str; items plus the characters of their strings for a list or tuple."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(x) for x in value if isinstance(x, (str, bytes)))
    return 0


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise TemplateLimitError(
            f"{what} would build {n} characters or items; at most {MAX_CHARS} are allowed"
        )


def _check_ints(values, what: str) -> None:
    for a in values:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateLimitError(f"{what} was given {a}; template calls take ints up to {MAX_INT_ARG}")


def _check_widths(fmt: str, what: str) -> None:
    """A `%` or `format` string asks for no field wider than MAX_INT_ARG."""
    _check_ints((int(d) for d in _DIGITS.findall(fmt) if len(d) > 5), what)


def _check_replace(text: str, old: str, new: str, what: str) -> None:
    hits = len(text) + 1 if old == "" else text.count(old)
    _check_size(len(text) + hits * (len(new) - len(old)), what)


def bounded_join(parts) -> str:
    """`~` (and a render's output): the parts' text, refused before it grows past MAX_CHARS."""
    out, total = [], 0
    for p in parts:
        text = str(p)
        total += len(text)
        _check_size(total, "joining text")
        out.append(text)
    return "".join(out)


def _joinable(items, sep, what: str) -> list:
    """`items` as a list, refused (TemplateLimitError) as soon as joining them with `sep` would
    pass MAX_CHARS characters: the check runs before any joined text is built."""
    out, total, step = [], 0, len(str(sep))
    for x in items:
        total += len(x) if isinstance(x, str) else len(str(x))
        total += step if out else 0
        _check_size(max(total, len(out) + 1), what)
        out.append(x)
    return out


def _bounded_join_filter(join: Callable) -> Callable:
    """jinja's `join` filter on items whose joined size was checked first."""
    from jinja2.filters import make_attrgetter

    def bounded(eval_ctx, value, d="", attribute=None):
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        return join(eval_ctx, _joinable(value, d, "the filter 'join'"), d)

    bounded.jinja_pass_arg = join.jinja_pass_arg
    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame) -> None:  # `a ~ b` through bounded_join, not str_join
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _mul(a, b):
    n, seq = (a, b) if _is_int(a) else (b, a)
    if _is_int(n) and _weight(seq):
        _check_size(_weight(seq) * max(n, 0), "repeating a sequence")
    return operator.mul(a, b)


def _pow(a, b):
    if _is_int(a) and _is_int(b) and abs(a) > 1 and b * abs(a).bit_length() > MAX_POW_BITS:
        raise TemplateLimitError(f"{a} ** {b} is a number of more than {MAX_POW_BITS} bits")
    return operator.pow(a, b)


def _mod(a, b):
    if isinstance(a, str):
        _check_widths(a, "string formatting")
        if "*" in a:  # widths taken from the arguments
            _check_ints(b if isinstance(b, tuple) else (b,), "string formatting")
    return operator.mod(a, b)


def _add(a, b):
    if _weight(a) and _weight(b):
        _check_size(_weight(a) + _weight(b), "adding sequences")
    return operator.add(a, b)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with this module's bounds (see its docstring)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    _binops = {"*": _mul, "**": _pow, "%": _mod, "+": _add}

    def __init__(self, **options):
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # builds as many paragraphs as it is asked for
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["join"] = _bounded_join_filter(self.filters["join"])

    @staticmethod
    def bounded_join(parts) -> str:
        return bounded_join(parts)

    def call_binop(self, context, operator: str, left, right):
        op = self._binops.get(operator)
        return op(left, right) if op is not None else super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):  # `'...'.format`: jinja's sandboxed formatter, width-checked
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_widths(value.__self__, f"{value.__name__}()")
        return wrapped

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        what = f"{getattr(__obj, '__name__', 'a call')}()"
        _check_ints((*args, *kwargs.values()), what)
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name == "replace" and len(args) >= 2:
            _check_replace(owner, str(args[0]), str(args[1]), what)
        if isinstance(owner, str) and name == "join" and len(args) == 1:
            args = (_joinable(args[0], owner, what),)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(_weight(result), what)
        return result


def _bounded_filter(name: str, f: Callable) -> Callable:
    """`f` refusing int arguments over MAX_INT_ARG (its first, the filtered value, is free)."""

    def bounded(*args, **kwargs):
        pass_arg = getattr(f, "jinja_pass_arg", None)
        own = args[1:] if pass_arg is not None else args  # context, eval context or environment
        what = f"the filter {name!r}"
        _check_ints((*own[1:], *kwargs.values()), what)
        if name == "format" and own and isinstance(own[0], str):
            _check_widths(own[0], what)
        if name == "replace" and len(own) >= 3 and isinstance(own[0], str):
            _check_replace(own[0], str(own[1]), str(own[2]), what)
        return f(*args, **kwargs)

    if hasattr(f, "jinja_pass_arg"):  # jinja passes the context or environment by this mark
        bounded.jinja_pass_arg = f.jinja_pass_arg
    return bounded


def _step_budget(steps: int) -> Callable:
    """A tracer that counts the lines run in template code and raises past `steps`; other code
    goes to the tracer that was there before (a debugger, coverage), if any."""
    previous = sys.gettrace()
    left = [steps]

    def local(frame, event, arg):
        if event == "line":
            left[0] -= 1
            if left[0] < 0:
                raise TemplateLimitError(f"the template ran more than {steps} steps")
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return local
        return previous(frame, event, arg) if previous is not None else None

    return tracer


def render_bounded(template: jinja2.Template, origin: str, error: type[Exception], **values) -> str:
    """Render within the step and output bounds; any failure is `error` naming `origin`."""
    previous = sys.gettrace()
    sys.settrace(_step_budget(MAX_STEPS))
    try:
        return bounded_join(template.generate(**values))
    except RecursionError:
        raise error(f"chat template ({origin}) failed: it recurses too deeply") from None
    except Exception as exc:  # noqa: BLE001 - code from a checkpoint: every failure is its own
        raise error(f"chat template ({origin}) failed: {type(exc).__name__}: {exc}"[:1000]) from None
    finally:
        sys.settrace(previous)
