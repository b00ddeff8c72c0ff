"""The line of a compiler's output that says what went wrong, for CompileError messages.

    triton_cause(exc)        # 'async_copy_global_to_shared has been removed; call async_load
                             #  instead (at 19:16 of _producer: tma_load(k_desc, ...))'
    triton_context(exc)      # the innermost located error: 'at 19:16:', the source, '^', the message
    nvrtc_cause(log)         # 'kernel(12): error: identifier "x" is undefined'

Triton wraps an error in one CompilationError per enclosing @jit function (and per
warp_specialize partition); each says only where ("at 18:4:", the source, a caret), and the
message itself is at the bottom of the chain. NVRTC's log ends with a count ("1 error detected
in ..."); its first error line names the cause (later ones often follow from it).
"""

from __future__ import annotations

import re

_LOCATION = re.compile(r"^at \d+:\d+:$")
_CARET = re.compile(r"^\s*\^[\s^~]*$")
_NVRTC_COUNT = re.compile(r"^\d+ errors? detected in the compilation of")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from, outermost first (cycles cut)."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in out):
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


def _text(exc: BaseException) -> str:
    message = getattr(exc, "error_message", None)  # Triton's CompilationError keeps its own
    return message if isinstance(message, str) and message.strip() else str(exc)


def _message_lines(text: str) -> list[str]:
    """The lines of `text` that can say what went wrong: after a located excerpt's caret (the
    source above it is not a message), without locations or blank lines."""
    lines = text.splitlines()
    carets = [i for i, line in enumerate(lines) if _CARET.match(line)]
    if carets:
        lines = lines[carets[-1] + 1 :]
    return [s for s in (line.strip() for line in lines) if s and not _LOCATION.match(s)]


def _located(text: str) -> tuple[str, str] | None:
    """('19:16', 'the source line the caret points at') of a located excerpt, else None."""
    lines = text.splitlines()
    carets = [i for i, line in enumerate(lines) if _CARET.match(line)]
    if not lines or not carets or carets[0] == 0 or not _LOCATION.match(lines[0].strip()):
        return None
    return lines[0].strip()[3:-1], lines[carets[0] - 1].strip()


def triton_cause(exc: BaseException) -> str:
    """The compiler's own last meaningful line: the innermost message of the chain, with the
    innermost location and source line when Triton gave one."""
    chain = _chain(exc)
    cause = next((lines[-1] for e in reversed(chain) if (lines := _message_lines(_text(e)))), "")
    cause = cause or type(chain[-1]).__name__
    located = next((e for e in reversed(chain) if _located(str(e))), None)
    if located is None:
        return cause
    loc, source = _located(str(located))
    fn = re.search(r"\bdef\s+(\w+)", getattr(located, "src", None) or "")  # the @jit function's source
    source = source if len(source) <= 80 else source[:77] + "..."
    return f"{cause} (at {loc}{' of ' + fn.group(1) if fn else ''}: {source})"


def triton_context(exc: BaseException) -> str:
    """The innermost located excerpt of the chain (location, source, caret, message), or the
    innermost exception's text when none is located."""
    chain = _chain(exc)
    return next((str(e).strip() for e in reversed(chain) if _located(str(e))), str(chain[-1]).strip())


def nvrtc_cause(log: str, word: str = "error") -> str:
    """NVRTC's first line in `log` that holds `word` ("error", or "warning" for a log that only
    warns); else the log's last meaningful line."""
    lines = [
        s for s in (line.strip(" \t\x00") for line in log.splitlines()) if s and not _NVRTC_COUNT.match(s)
    ]
    found = [s for s in lines if re.search(rf"\b{word}\b", s, re.IGNORECASE)]
    return found[0] if found else (lines[-1] if lines else "no compiler output")
