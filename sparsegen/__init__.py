"""sparsegen: JIT-compiled block-sparse attention kernels from per-head sparsity specs.

The public names load on first use (PEP 562), so `import sparsegen.cli` and
`sparsegen --version` do not pay for torch; `import sparsegen; sparsegen.prefill` behaves
as an eager import would.
"""

from __future__ import annotations

import importlib

from .errors import (
    ArchError,
    CacheError,
    CacheOutOfMemory,
    CheckpointError,
    CompileError,
    DistributedError,
    EngineError,
    EnvError,
    FuzzMismatch,
    ImplUnavailableError,
    InputError,
    JitDisabledError,
    MemoryLimitError,
    MissingExtraError,
    RenderLimitError,
    RequestError,
    RequestFailedError,
    ServerOverloaded,
    SparsegenError,
    SpecError,
    TemplateLimitError,
    TokenizerError,
)

__version__ = "0.1.0"

# public name -> the module that defines it (relative to this package)
_LAZY = {
    "reference": ".reference",
    "density": ".layout",
    "visible_mask": ".layout",
    "get_kernel": ".ops",
    "lookup_kernel": ".ops",
    "paged_decode": ".ops",
    "prefill": ".ops",
    "get_pattern": ".presets",
    "HeadSpec": ".spec",
    "LayerSpec": ".spec",
    "ModelSpec": ".spec",
    # the serving API loads the model code and jinja2's sandbox: only when first asked for
    "LLM": ".llm",
    "SamplingParams": ".request.sampling_params",
    "StructuredOutputsParams": ".request.structured_outputs",
    "GuidedDecodingParams": ".request.structured_outputs",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'sparsegen' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = module if name == "reference" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ArchError",
    "CacheError",
    "CacheOutOfMemory",
    "CheckpointError",
    "CompileError",
    "DistributedError",
    "EngineError",
    "EnvError",
    "FuzzMismatch",
    "GuidedDecodingParams",
    "HeadSpec",
    "ImplUnavailableError",
    "InputError",
    "JitDisabledError",
    "LLM",
    "LayerSpec",
    "MemoryLimitError",
    "MissingExtraError",
    "ModelSpec",
    "RenderLimitError",
    "RequestError",
    "RequestFailedError",
    "SamplingParams",
    "ServerOverloaded",
    "SparsegenError",
    "SpecError",
    "StructuredOutputsParams",
    "TemplateLimitError",
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
