"""Every plain-text option of every command is UTF-8 text.

Python spells each byte of a non-UTF-8 argument as a lone surrogate ('\\udcff'); a prompt, a stop
string or a host name holding one would fail deep inside (UnicodeEncodeError, exit 1 with a
traceback). `utf8_text_options(command)` gives each plain `str` option of a command (and of its
subcommands) the `Utf8Text` type, so such an argument is a usage error naming the option
(exit 2). Options that may name a file (`--pattern`: a preset or a spec file) keep plain str,
as file names may be any bytes; `click.Path` options are never touched.
"""

from __future__ import annotations

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


UTF8_TEXT = Utf8Text()


def utf8_text_options(command: click.Command) -> click.Command:
    """`command` with UTF8_TEXT for each plain str parameter (in place, so repeat calls are free)."""
    for param in command.params:
        if type(param.type) is click.types.StringParamType and param.name not in MAY_NAME_A_FILE:
            param.type = UTF8_TEXT
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            utf8_text_options(sub)
    return command
