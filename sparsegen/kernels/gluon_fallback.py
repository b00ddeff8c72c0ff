"""The default sm_90 prefill falls back to the tl kernel when the Gluon kernel does not build on
a Triton that sparsegen has not tested.

Gluon is Triton's experimental layer and its API moves between releases; the releases in
`jit.triton_support.TESTED` are built in CI, so a build failure on one of them is a bug and is
raised. On any other Triton, a prefill whose variant the caller left to `default_variant` gets
the tl kernel instead, and the "sparsegen" logger says so once per cause, naming the Triton
version and the compiler's own error line; a Triton without a usable Gluon at all is said once
too (`warn_once`, from `base.default_variant`). A request that names `variant="gluon"` never
comes here: its CompileError reaches the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CompileError
from ..jit import triton_support
from ..log import get_logger

log = get_logger(__name__)
# Caches, per process: the Gluon requests that failed to build (-> the first line of their
# error, so a layer is not rebuilt to fail again), and the warnings already logged.
_FAILED: dict[Any, str] = {}
_WARNED: set[str] = set()


def forget() -> None:
    """Drop what this process learnt (with the kernel memos, `base.forget`)."""
    _FAILED.clear()
    _WARNED.clear()


def warn_once(why: str) -> None:
    """Log, once per process and reason, that the sm_90 prefill takes the tl kernel because of `why`."""
    message = f"{why}. The sm_90 prefill uses the tl kernel instead (SPARSEGEN_PREFILL_TL=1 chooses it without this warning)"
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def lookup_defaulted(request, lookup: Callable[[Any], Any]):
    """`lookup(request)` for a Gluon prefill request the caller did not name a variant for; on an
    untested Triton, a CompileError gives `lookup` of the same request with variant "tl"."""
    cause = _FAILED.get(request)
    version = triton_support.installed() or "(unknown)"
    if cause is None:
        try:
            return lookup(request)
        except CompileError as exc:
            if triton_support.tested(version):
                raise
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _FAILED[request] = cause
    warn_once(
        f"the Gluon prefill kernel does not build with Triton {version}, a release sparsegen has "
        f"not tested ({', '.join(triton_support.TESTED)}): {cause}"
    )
    tl = request.make(request.kind, request.layer, dtype=request.dtype, arch=request.arch, variant="tl")
    return lookup(tl)
