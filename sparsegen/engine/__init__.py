"""The bundled decoding loop: continuous batching and chunked prefill (`scheduler`) and
`LLMEngine` (`engine`), over an `executor.Executor` that runs the model.

The engine is the top of the generation stack, `request` < `runner` < `parallel` < `engine`:
it schedules `request.sequence.Plan`s and hands them to the executor (a
`runner.model_runner.ModelRunner` in this process, or `parallel`'s ranks), and never knows how
many ranks run the model. The paged KV cache and the sampler are the runner's
(`runner.kv_cache`, `runner.sampling`); the names below are re-exported for callers of
`sparsegen.engine`. Request outputs (`engine.outputs`) come from the one output path,
`engine.output_processor`, which `LLM`, the server and the CLI share.
"""

from ..request.sampling_params import SamplingParams
from ..runner.kv_cache import CacheOutOfMemory, KVCache, PageAllocator
from ..runner.sampling import sample
from .engine import LLMEngine, TokenEvent
from .outputs import CompletionOutput, RequestOutput
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
