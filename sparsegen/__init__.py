"""sparsegen: JIT-compiled block-sparse attention kernels from per-head sparsity specs."""

from . import reference
from .errors import (
    ArchError,
    CacheError,
    CacheOutOfMemory,
    CheckpointError,
    CompileError,
    EngineError,
    EnvError,
    ImplUnavailableError,
    InputError,
    JitDisabledError,
    MemoryLimitError,
    RequestError,
    ServerOverloaded,
    SparsegenError,
    SpecError,
    TokenizerError,
)
from .layout import density, visible_mask
from .ops import get_kernel, lookup_kernel, paged_decode, prefill
from .presets import get_pattern
from .spec import HeadSpec, LayerSpec, ModelSpec

__version__ = "0.1.0"

__all__ = [
    "ArchError",
    "CacheError",
    "CacheOutOfMemory",
    "CheckpointError",
    "CompileError",
    "EngineError",
    "EnvError",
    "HeadSpec",
    "ImplUnavailableError",
    "InputError",
    "JitDisabledError",
    "LLM",
    "LayerSpec",
    "MemoryLimitError",
    "ModelSpec",
    "RequestError",
    "SamplingParams",
    "ServerOverloaded",
    "SparsegenError",
    "SpecError",
    "TokenizerError",
    "density",
    "get_kernel",
    "get_pattern",
    "lookup_kernel",
    "paged_decode",
    "prefill",
    "reference",
    "visible_mask",
]


def __getattr__(name: str):
    # The serving API loads the model code and jinja2's sandbox: only when first asked for.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'sparsegen' has no attribute {name!r}")
