"""Prefill kernels through the lifecycle: the getters above `kernels.base`.

    kernel = get_prefill_kernel(layer, dtype=torch.bfloat16)   # compiled on first use, then cached
    out = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k)          # [Tq, H, D]
    keys = precompile(layers, ["bf16", "fp16"], arch="sm_90")  # many at once, into the disk cache

The families themselves (what renders, builds and loads a kernel) are `families.prefill_tl`
(variant "tl") and `families.prefill_gluon` (variant "gluon", sm_90); `base.default_variant`
picks between them.
"""

from __future__ import annotations

from .. import env
from ..spec import LayerSpec
from . import base
from .families.prefill_tl import LOG2E, Launch, PrefillKernel, TritonPrefill

current_arch = env.current_arch  # kept for callers of the old name
forget = base.forget


def get_prefill_kernel(layer: LayerSpec, *, dtype, arch: str | None = None, variant=None) -> PrefillKernel:
    """The prefill kernel for `layer` (compiled on first use, then from the cache)."""
    return base.get("prefill", layer, dtype=dtype, arch=arch, variant=variant)


def precompile(layers, dtype_list, *, arch: str) -> list[str]:
    """Build many kernels into the disk cache side by side (`build_workers.map_in_threads`: the
    lifecycle in threads, the Triton builds in worker processes); their keys, in order."""
    from ..jit import build_workers

    jobs = [(layer, dt) for layer in dict.fromkeys(layers) for dt in dtype_list]
    return build_workers.map_in_threads(
        lambda job: get_prefill_kernel(job[0], dtype=job[1], arch=arch).key, jobs, triton_builds=len(jobs)
    )


__all__ = ["LOG2E", "Launch", "PrefillKernel", "TritonPrefill", "current_arch", "forget", "get_prefill_kernel",
           "precompile"]  # fmt: skip
