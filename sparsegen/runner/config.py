"""`EngineConfig`: the engine's arguments, each checked for its exact type and range at construction.

Nothing is coerced: `page_size=16.5`, `num_pages=0` or `max_model_len=True` is an `InputError`
naming the argument, before any memory is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtypes import KV_CACHE_DTYPE_NAMES
from ..errors import InputError

# The compiled decode kernel takes pages of 8..128 tokens; the reference takes any size, but
# pages longer than 128 tokens only waste the tail page of every sequence.
MAX_PAGE_SIZE = 128
# A collective's timeout becomes a `datetime.timedelta` and then whole milliseconds in torch's
# process groups: below a millisecond it rounds to 0, and past `timedelta.max` it overflows.
MIN_COLLECTIVE_TIMEOUT_S = 1e-3
MAX_COLLECTIVE_TIMEOUT_S = 365 * 24 * 3600.0
KERNEL_PAGE_SIZES = range(8, MAX_PAGE_SIZE + 1)
KV_LAYOUTS = ("head", "token")  # the KV pages' memory order: head-major or token-major (runner.kv_cache)
# the KV cache's element type: "auto" is the model's dtype; the fp8 names are vLLM's (dtypes)
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_NAMES)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """An exact int (not a bool) in low..high; the error names the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise InputError(f"{name} must be {span}, got {value}")
    return value


def check_optional_int(name: str, value: object, low: int, high: int | None = None) -> int | None:
    return None if value is None else check_int(name, value, low, high)


# Prefill tokens per step by default. The scheduler runs every pending prefill before any decode
# step, so the chunk size does not bound how long running sequences wait; it bounds a step's
# activations (bench_generate's peak GPU memory with the 7b model: 63.6 GiB with 8K chunks,
# 66.7 GiB with 32K), which the model runner checks against free memory with the KV cache
# (models.memory.prefill_activation_bytes). Measured on the H200 (benchmarks/engine/ab_prefill.py
# --chunks), a 32K-token prompt in one chunk took 970-978 ms to its first token, in 8K chunks
# 986-998 ms: no K/V gather of earlier chunks, one attention launch a layer.
PREFILL_CHUNK_TOKENS = 32768


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is sized. `None` means "derive it": `num_pages` from `kv_cache_bytes` (or
    from free memory), `max_model_len` from the model's `max_position_embeddings`."""

    page_size: int = 16
    num_pages: int | None = None  # pages in the cache, one of them kept as scratch (>= 2)
    kv_cache_bytes: int | None = None  # budget for the cache when num_pages is None
    max_num_seqs: int = 32  # sequences running at once
    max_num_batched_tokens: int = PREFILL_CHUNK_TOKENS  # prefill tokens per step
    max_model_len: int | None = None  # prompt + generated tokens per sequence
    use_cuda_graphs: bool = True
    compile_model: bool = False  # decode steps through torch.compile (inductor), inside the graphs
    # launch each decode step before the previous one's tokens reach the host (runner.inflight);
    # greedy and seeded tokens are the same either way
    async_decode: bool = True
    kv_layout: str = "head"  # one of KV_LAYOUTS
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES (fp8: models.kv_scales)
    # ranks that run the model (one GPU each), below the engine (engine.executor); 1: this process
    tensor_parallel_size: int = 1
    # tensor parallelism: seconds a collective may wait for a peer before it fails
    # (None: parallel.distributed.DEFAULT_TIMEOUT_S)
    collective_timeout_s: float | None = None
    # automatic prefix caching: full KV pages are kept, by the hash of their tokens and prefix,
    # for later requests with the same prefix (engine.prefix_cache, runner.page_pool)
    enable_prefix_caching: bool = True
    # every layer's attention dense causal (its soft-cap, learned sinks and scale kept), same
    # weights: the model's `set_force_dense(True)`, for comparing a window model with itself
    dense_attention: bool = False
    # vLLM's: the share of the GPU's whole memory the engine may take for weights, KV cache and a
    # step's activations, when num_pages and kv_cache_bytes are None (None: 90 % of the free
    # memory less a headroom; runner.model_runner.default_num_pages). Not used on a CPU.
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        check_optional_int("num_pages", self.num_pages, 2)
        check_optional_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_optional_int("max_model_len", self.max_model_len, 2)
        for name in (
            "use_cuda_graphs",
            "compile_model",
            "async_decode",
            "enable_prefix_caching",
            "dense_attention",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise InputError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InputError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise InputError(f"gpu_memory_utilization must be None or a number in (0, 1], got {u!r:.40}")
        t = self.collective_timeout_s
        if t is not None and (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not MIN_COLLECTIVE_TIMEOUT_S <= t <= MAX_COLLECTIVE_TIMEOUT_S
        ):
            raise InputError(
                f"collective_timeout_s must be None or a number of seconds in {MIN_COLLECTIVE_TIMEOUT_S:g}.."
                f"{MAX_COLLECTIVE_TIMEOUT_S:g}, got {t!r:.40}"
            )
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:
            raise InputError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with tensor_parallel_size > 1 "
                "(per-KV-head scales are not sharded); use kv_cache_dtype='auto'"
            )

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's torch dtype for a model of `model_dtype`."""
        return model_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPE_NAMES[self.kv_cache_dtype]
