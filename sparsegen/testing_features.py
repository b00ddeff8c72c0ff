"""Hypothesis strategies for the optional attention features (sink tokens, soft-cap, learned
sinks, a layer's own scale, head dims 32..256), next to `sparsegen.testing`'s base strategies.

    @given(feature_problems(feature_layers(family=TritonPrefill()), max_len=200))
    def test_mine(fp):
        out = sparsegen.prefill(*fp.args(), impl="triton")
        assert_close_rows(out, fp.reference())

`feature_layers(family=...)` draws only what that kernel family declares (`Family.features`,
`Family.head_dims`), so a kernel test never draws a layer its kernel refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from hypothesis import strategies as st

from . import reference
from .spec import LayerSpec
from .testing import BLOCK_SIZES, PrefillProblem, _oracle_args, head_specs

ALL_FEATURES = ("sink_tokens", "logit_softcap", "learned_sinks")
FEATURE_HEAD_DIMS = tuple(range(32, 257, 16))


@st.composite
def feature_layers(
    draw,
    family=None,
    head_dims: tuple[int, ...] | None = None,
    max_kv_heads: int = 2,
    gqa_ratios: tuple[int, ...] = (1, 2, 4),
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
    max_sink_tokens: int = 40,
) -> LayerSpec:
    """A valid LayerSpec using some of the features `family` declares (all of them without a
    family) and one of its head dims; heads may mix kinds, each may carry sink tokens."""
    allowed = ALL_FEATURES if family is None else tuple(f for f in ALL_FEATURES if f in family.features)
    dims = head_dims or (FEATURE_HEAD_DIMS if family is None else tuple(family.head_dims))
    if family is not None:
        dims = tuple(d for d in dims if d in family.head_dims)
    on = {f: draw(st.booleans()) for f in allowed}
    num_kv = draw(st.integers(1, max_kv_heads))
    num_heads = num_kv * draw(st.sampled_from(gqa_ratios))
    heads = []
    for _ in range(num_heads):
        head = draw(head_specs(block_size=draw(st.sampled_from(block_sizes))))
        if on.get("sink_tokens") and not head.dense and draw(st.booleans()):
            head = replace(head, sink_tokens=draw(st.integers(1, max_sink_tokens)))
        heads.append(head)
    softcap = draw(st.sampled_from((1.0, 5.0, 30.0, 50.0))) if on.get("logit_softcap") else 0.0
    scale = draw(st.none() | st.floats(0.02, 0.5))
    return LayerSpec(num_heads=num_heads, num_kv_heads=num_kv, head_dim=draw(st.sampled_from(dims)),
                     heads=tuple(heads), logit_softcap=softcap, learned_sinks=on.get("learned_sinks", False),
                     scale=scale)  # fmt: skip


def random_sinks(layer: LayerSpec, seed: int, device="cpu") -> torch.Tensor | None:
    """sinks: [H] float32 logits in about [-3, 3] for a learned-sinks layer, else None."""
    if not layer.learned_sinks:
        return None
    gen = torch.Generator().manual_seed(seed + 7919)
    return (torch.randn(layer.num_heads, generator=gen) * 1.5).to(device)


@dataclass
class FeatureProblem:
    """A PrefillProblem plus its `sinks` tensor (when the layer has learned sinks)."""

    problem: PrefillProblem
    sinks: torch.Tensor | None = field(default=None, repr=False)

    def args(self) -> tuple:
        return self.problem.args()

    def kwargs(self) -> dict:
        return {} if self.sinks is None else {"sinks": self.sinks}

    def reference(self, *, exact: bool = True) -> torch.Tensor:
        """float64 math on the CPU, or (exact=False) float32 where the tensors are; sinks stay
        float32, as the contract takes them."""
        sinks = None if self.sinks is None else self.sinks.float()
        if sinks is not None and exact:
            sinks = sinks.cpu()
        return reference.prefill(*_oracle_args(self.args(), exact), sinks=sinks)

    def repro(self) -> str:
        return f"{self.problem.repro()} sinks={None if self.sinks is None else self.sinks.tolist()}"


@st.composite
def feature_problems(
    draw, layers, max_batch: int = 2, max_len: int = 200, dtype=torch.float16, device="cpu"
) -> FeatureProblem:
    """A FeatureProblem on `layers`: random lengths (a cached prefix now and then) and sinks."""
    layer = draw(layers)
    batch = draw(st.integers(1, max_batch))
    k_lens = [draw(st.integers(1, max_len)) for _ in range(batch)]
    q_lens = [draw(st.sampled_from((k, k, max(1, k // 3)))) for k in k_lens]
    seed = draw(st.integers(0, 2**16))
    return FeatureProblem(
        PrefillProblem(layer, q_lens, k_lens, seed=seed, dtype=dtype, device=device),
        random_sinks(layer, seed, device=device),
    )


def sample_feature_layers(seed: int, count: int, on_gpu: bool) -> list[LayerSpec]:
    """`count` layers drawn by `feature_layers` for the tl prefill kernel, reproducibly from
    `seed` (`sparsegen fuzz --features`); the interpreter gets small heads (32, 48, 80)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from .kernels.families.prefill_tl import TritonPrefill

    dims = None if on_gpu else (32, 48, 80)
    out: list[LayerSpec] = []

    @hseed(seed)
    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(feature_layers(family=TritonPrefill(), head_dims=dims, max_kv_heads=4 if on_gpu else 2))
    def draw(layer):
        out.append(layer)

    draw()
    return list(dict.fromkeys(out))[:count]


__all__ = ["ALL_FEATURES", "FEATURE_HEAD_DIMS", "FeatureProblem", "feature_layers", "sample_feature_layers",
           "feature_problems", "random_sinks"]  # fmt: skip
