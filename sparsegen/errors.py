"""The exception types sparsegen raises, so callers can catch them by kind."""


class SparsegenError(Exception):
    """Base class for sparsegen's own errors."""


class SpecError(SparsegenError, ValueError):
    """An invalid sparsity spec; the message names the field and the value."""


class InputError(SparsegenError, ValueError):
    """A tensor argument has the wrong dtype, shape, device, stride or contents."""


class ImplUnavailableError(SparsegenError, RuntimeError):
    """An explicitly requested implementation cannot run here (no GPU, no interpreter...)."""


class JitDisabledError(SparsegenError, RuntimeError):
    """SPARSEGEN_DISABLE_JIT=1 and the kernel is not in the cache."""


class CompileError(SparsegenError, RuntimeError):
    """Rendering or compiling a kernel failed."""


class CacheError(SparsegenError, RuntimeError):
    """The kernel cache cannot be used (unsafe directory, unreadable entry...)."""


class DistributedError(SparsegenError, RuntimeError):
    """A tensor-parallel rank died, timed out in a collective, or could not start; names the rank."""
