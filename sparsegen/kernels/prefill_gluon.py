"""The Hopper Gluon prefill kernel through the lifecycle: the getter above `kernels.base`.

    kernel = get_gluon_prefill_kernel(layer, dtype=torch.bfloat16)              # sm_90, cached
    tuned = get_gluon_prefill_kernel(layer, dtype=torch.bfloat16, stages=2)     # a config knob

The family (template, TMA descriptors, build and load) is `families.prefill_gluon`.
"""

from __future__ import annotations

from ..spec import LayerSpec
from . import base
from .families.prefill_gluon import ARCH, ARG_NAMES, LOG2E, GluonPrefill, GluonPrefillKernel, signature


def get_gluon_prefill_kernel(layer: LayerSpec, *, dtype, **overrides) -> GluonPrefillKernel:
    """The Gluon kernel for `layer` through the lifecycle (cached); `overrides` (benchmarks,
    tests: tile, stages, persistence, ...; keys of prefill_gluon_template.CONFIG) are the
    request's knobs, so such a kernel is cached like the default one."""
    return base.get("prefill", layer, dtype=dtype, arch=ARCH, variant="gluon", knobs=overrides or None)


__all__ = ["ARCH", "ARG_NAMES", "LOG2E", "GluonPrefill", "GluonPrefillKernel", "get_gluon_prefill_kernel",
           "signature"]  # fmt: skip
