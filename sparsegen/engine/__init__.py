"""The bundled decoding loop: paged KV cache, continuous batching, chunked prefill, sampling, and
the one output path from token events to request outputs."""

from .engine import LLMEngine, TokenEvent
from .kv_cache import CacheOutOfMemory, KVCache, PageAllocator
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Sequence

__all__ = [
    "CacheOutOfMemory",
    "CompletionOutput",
    "KVCache",
    "LLMEngine",
    "PageAllocator",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "Sequence",
    "TokenEvent",
    "sample",
]
