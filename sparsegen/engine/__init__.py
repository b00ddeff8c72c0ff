"""The bundled decoding loop: paged KV cache, continuous batching, chunked prefill, sampling."""

from .engine import GenerationResult, LLMEngine, TokenEvent
from .kv_cache import CacheOutOfMemory, KVCache, PageAllocator
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Sequence

__all__ = [
    "CacheOutOfMemory",
    "GenerationResult",
    "KVCache",
    "LLMEngine",
    "PageAllocator",
    "SamplingParams",
    "Scheduler",
    "Sequence",
    "TokenEvent",
    "sample",
]
