"""Text someone else gave us (a prompt, a chat message, a stop string, a CLI argument) must be
text UTF-8 can encode.

Python spells a byte of a non-UTF-8 argv or file name as a lone surrogate ('\\udcff'), and JSON
may carry one as an escape; neither is a character, so no tokenizer can encode it and no
decoded text can match it. `check_utf8` refuses it up front with the caller's error type,
naming the field and the position, instead of a UnicodeEncodeError from deep inside.
"""

from __future__ import annotations


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_utf8(text: str, where: str, error: type[Exception]) -> str:
    """`text` itself, or `error` naming `where` if it holds a lone surrogate."""
    at = lone_surrogate(text)
    if at is not None:
        raise error(
            f"{where} holds {text[at]!r} at character {at}, a lone surrogate that is not text (a "
            "non-UTF-8 byte, or half of a UTF-16 pair); pass valid UTF-8 text"
        )
    return text
