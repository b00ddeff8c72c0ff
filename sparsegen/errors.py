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


class RenderLimitError(CompileError):
    """A kernel template rendered more source than `jit.render.RENDER_BUDGET` allows (a runaway
    template or spec); refused before anything compiles. `template`, `limit` and `spec` (the
    kernel's name and spec JSON, where the kernel cache knows them) name what was refused."""

    def __init__(self, message: str, *, template: str, limit: int, spec: str | None = None):
        super().__init__(message)
        self.template, self.limit, self.spec = template, limit, spec


class CacheError(SparsegenError, RuntimeError):
    """The kernel cache cannot be used (unsafe directory, unreadable entry...)."""


class ArchError(InputError):
    """A GPU arch that is not a known `sm_XY` string of sm_80 or newer (e.g. 90, '', 'sm_90aa')."""


class EnvError(SparsegenError, ValueError):
    """An environment variable sparsegen reads holds a value it cannot interpret; names it."""


class CheckpointError(SparsegenError, ValueError):
    """A checkpoint folder, its config.json or its tensors cannot be used; names the file."""


class TokenizerError(SparsegenError, ValueError):
    """A tokenizer file is missing or malformed, or ids are out of range; names the file or id."""


class CacheOutOfMemory(SparsegenError, RuntimeError):
    """The KV cache has too few free pages for what was asked; the message gives the numbers."""


class EngineError(SparsegenError, RuntimeError):
    """The engine was asked for something its current state forbids (e.g. warmup while busy)."""


class RequestFailedError(SparsegenError, RuntimeError):
    """One request failed inside an engine step (its sampling raised); the other requests of
    the step went on. The message names the request and the cause."""


class MemoryLimitError(SparsegenError, RuntimeError):
    """What was asked (model weights, KV cache) would not fit in the memory the device has;
    raised from an estimate before anything is allocated. The message gives the numbers."""


class RequestError(InputError):
    """A request the HTTP server refuses: `status` is the HTTP code (400 unless said), `param`
    names the field, `code` is OpenAI's error code (or None)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class ServerOverloaded(SparsegenError, RuntimeError):
    """The server's queue is full, or it is shutting down; the client should retry later (HTTP 503)."""


class MissingExtraError(SparsegenError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""


class DistributedError(SparsegenError, RuntimeError):
    """A tensor-parallel rank died, timed out in a collective, or could not start; names the rank."""


class TemplateLimitError(InputError):
    """A chat template from a checkpoint went over one of the render sandbox's bounds (size,
    steps, int arguments); `llm.template_sandbox` raises it, and the render reports it naming the
    template."""


class FuzzMismatch(SparsegenError, AssertionError):
    """A `sparsegen fuzz` case failed (a kernel error, or rows over the tolerance); the message
    says how. Raised inside the hypothesis test so that hypothesis shrinks the case."""
