"""The types every command's options get, whatever the command declares: text is UTF-8, floats
are finite.

- Python spells each byte of a non-UTF-8 argument as a lone surrogate ('\\udcff'); a prompt, a
  stop string or a host name holding one would fail deep inside (UnicodeEncodeError, exit 1
  with a traceback). Each plain `str` option gets `Utf8Text`, so such an argument is a usage
  error naming the option (exit 2). Options that may name a file (`--pattern`: a preset or a
  spec file) keep plain str, as file names may be any bytes; `click.Path` options are never
  touched.
- click's float types take 'nan', 'inf' and '-inf' (and FloatRange lets NaN through any bound:
  every comparison with it is false). Each float option gets the same type refusing them, with
  its range kept.
`checked_options(command)` sets both on a command and its subcommands; `cli.py` applies it to
every command it loads.
"""

from __future__ import annotations

import math

import click

from ..utf8 import lone_surrogate

MAY_NAME_A_FILE = frozenset({"pattern"})


class Utf8Text(click.types.StringParamType):
    name = "text"

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        at = lone_surrogate(value)
        if at is not None:
            self.fail(
                f"{value!r} holds a lone surrogate at character {at} (a byte that is not UTF-8); "
                "pass UTF-8 text",
                param,
                ctx,
            )
        return value


def _finite(self, value, param, ctx, convert):
    value = convert(self, value, param, ctx)
    if value is not None and not math.isfinite(value):
        self.fail(f"{value!r} is not a finite number", param, ctx)
    return value


class FiniteFloat(click.types.FloatParamType):
    def convert(self, value, param, ctx):
        return _finite(self, value, param, ctx, click.types.FloatParamType.convert)


class FiniteFloatRange(click.FloatRange):
    def convert(self, value, param, ctx):
        return _finite(self, value, param, ctx, click.FloatRange.convert)


UTF8_TEXT = Utf8Text()


def _checked_type(param: click.Parameter) -> click.ParamType:
    t = param.type
    if type(t) is click.types.StringParamType and param.name not in MAY_NAME_A_FILE:
        return UTF8_TEXT
    if type(t) is click.types.FloatParamType:
        return FiniteFloat()
    if type(t) is click.FloatRange:
        return FiniteFloatRange(t.min, t.max, min_open=t.min_open, max_open=t.max_open, clamp=t.clamp)
    return t


def checked_options(command: click.Command) -> click.Command:
    """`command` with these types on every parameter they fit (in place; repeat calls are free)."""
    for param in command.params:
        param.type = _checked_type(param)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            checked_options(sub)
    return command
