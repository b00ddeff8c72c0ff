"""The line of a compiler's output that says what went wrong, for CompileError messages.

    with stderr_captured() as err:       # C++ diagnostics (MLIR) go to fd 2, not to the exception
        ... triton.compile(...) ...
    triton_cause(exc, err.text)  # 'async_copy_global_to_shared has been removed; call async_load
                                 #  instead (at 19:16 of _producer: tma_load(k_desc, ...))'
    triton_context(exc)          # the innermost located error: 'at 19:16:', the source, '^', the message
    nvrtc_cause(log)             # 'kernel(12): error: identifier "x" is undefined'

Triton wraps a front-end error in one CompilationError per enclosing @jit function (and per
warp_specialize partition); each says only where ("at 18:4:", the source, a caret), and the
message itself is at the bottom of the chain. A ptxas failure names its cause in a "ptxas fatal"
line of the PTXASError (below it, a CalledProcessError says only "exit status 255"). A failed
MLIR pass raises "PassManager::run failed" and prints its diagnostics to fd 2, hence the capture.
NVRTC's log ends with a count ("1 error detected in ..."); its first error line names the cause
(later ones often follow from it).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading

_LOCATION = re.compile(r"^at \d+:\d+:$")
_CARET = re.compile(r"^\s*\^[\s^~]*$")
_NVRTC_COUNT = re.compile(r"^\d+ errors? detected in the compilation of")
# "ptxas fatal   : ..." (3.9 runs "ptxas-blackwell" even for sm_90); the "aborted" line only sums up
_PTXAS = re.compile(r"^\s*ptxas(?:-\w+)?\s+(?:fatal|error)\s*:\s*(?!Ptx assembly aborted)(.+)$", re.MULTILINE)
_MLIR = re.compile(r"^(\S+?):(\d+:\d+): (error|note): (.+)$", re.MULTILINE)
_GENERIC_MLIR = "Failures have been detected while processing an MLIR pass pipeline"
_CAPTURE = threading.Lock()  # fd 2 is the process's: one capture at a time


class Captured:
    """What a `stderr_captured` block wrote to fd 2 (set when the block ends)."""

    text = ""


@contextlib.contextmanager
def stderr_captured():
    """Send fd 2 to a temporary file for the block, then replay it to the real stderr (nothing is
    lost, only held back); the yielded `Captured` then holds the text."""
    box = Captured()
    with _CAPTURE, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            data = tmp.read()
            with open(2, "wb", closefd=False) as real:  # the replay
                real.write(data)
            box.text = data.decode(errors="replace")


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


def _ptxas_cause(texts: list[str]) -> str | None:
    found = next((m for text in texts if (m := _PTXAS.search(text))), None)
    return f"ptxas: {found.group(1).strip()}" if found else None


def mlir_cause(diagnostics: str) -> str | None:
    """MLIR's first error in captured stderr ('kernel.py:4:0: error: ...'); for the generic
    pipeline failure, with the pass its note names."""
    found = [(os.path.basename(m.group(1)), *m.group(2, 3, 4)) for m in _MLIR.finditer(diagnostics)]
    errors = [f for f in found if f[2] == "error"]
    if not errors:
        return None
    name, loc, _, message = next((f for f in errors if _GENERIC_MLIR not in f[3]), errors[0])
    line = f"{name}:{loc}: error: {message.strip()}"
    if _GENERIC_MLIR in message:
        note = next((f[3] for f in found if f[2] == "note" and "Pipeline failed while executing" in f[3]), "")
        line += f" ({note.split(']')[0] + ']'})" if "]" in note else ""
    return line


def triton_cause(exc: BaseException, diagnostics: str = "") -> str:
    """The compiler's own last meaningful line: a ptxas or MLIR error when there is one (in the
    chain's messages or in `diagnostics`, captured stderr), else the innermost message of the
    chain, with the innermost location and source line when Triton gave one."""
    chain = _chain(exc)
    tool = _ptxas_cause([_text(e) for e in chain] + [diagnostics]) or mlir_cause(diagnostics)
    said = [e for e in reversed(chain) if not isinstance(e, subprocess.CalledProcessError)]
    cause = tool or next((lines[-1] for e in said if (lines := _message_lines(_text(e)))), "")
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
    raised exception's own text when none is located (a PTXASError holds ptxas's output)."""
    chain = _chain(exc)
    return next((str(e).strip() for e in reversed(chain) if _located(str(e))), str(exc).strip())


def nvrtc_cause(log: str, word: str = "error") -> str:
    """NVRTC's first line in `log` that holds `word` ("error", or "warning" for a log that only
    warns); else the log's last meaningful line."""
    lines = [
        s for s in (line.strip(" \t\x00") for line in log.splitlines()) if s and not _NVRTC_COUNT.match(s)
    ]
    found = [s for s in lines if re.search(rf"\b{word}\b", s, re.IGNORECASE)]
    return found[0] if found else (lines[-1] if lines else "no compiler output")
