"""GPU tier (`pytest -m gpu`): the CUDA decode kernel with sink tokens, soft-cap, learned sinks and
head dims 32..256, against sparsegen.reference per (row, head), on fuzzed specs in bf16 and fp16,
NaN-poisoned outputs, unsplit and split (fused and separate merges)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers.poison import poison_next_alloc

import sparsegen
from sparsegen import HeadSpec, LayerSpec, reference
from sparsegen.kernels.decode import get_decode_kernel
from sparsegen.testing import DecodeProblem, row_mismatch, sample_layer_spec

pytestmark = pytest.mark.gpu

HEAD_DIMS = tuple(range(32, 257, 16))


def _with_features(rng: random.Random, layer: LayerSpec) -> LayerSpec:
    """The layer with sink tokens on some non-dense heads, maybe soft-cap, maybe learned sinks."""
    n = rng.choice((0, 1, 4, 64, 100))
    heads = tuple(
        h if h.dense or rng.random() < 0.3 else dataclasses.replace(h, sink_tokens=n) for h in layer.heads
    )
    return dataclasses.replace(
        layer,
        heads=heads,
        logit_softcap=rng.choice((0.0, 0.0, 5.0, 30.0, 50.0)),
        learned_sinks=rng.random() < 0.6,
    )


def _specs() -> list[LayerSpec]:
    rng = random.Random(2929)
    out = [
        LayerSpec(
            8, 1, 64, (HeadSpec(block_size=16, sliding_window=128),) * 8, learned_sinks=True
        ),  # gpt-oss-like
        LayerSpec(
            2, 1, 256, (HeadSpec(block_size=64, sliding_window=4096),) * 2, logit_softcap=50.0
        ),  # Gemma-2-like
        LayerSpec(
            4, 1, 128, (HeadSpec(block_size=64, sliding_window=256, sink_tokens=4),) * 4
        ),  # StreamingLLM
    ]
    for n in range(17):
        out.append(_with_features(rng, sample_layer_spec(rng, hybrid=bool(n % 2), head_dims=HEAD_DIMS)))
    return out


SPECS = _specs()


def _reference(p: DecodeProblem, sinks) -> torch.Tensor:
    q, kc, vc, bt, sl, layer, scale = p.args()
    return reference.paged_decode(q.cpu().double(), kc.cpu().double(), vc.cpu().double(), bt.cpu(), sl.cpu(),
                                  layer, scale, sinks=None if sinks is None else sinks.cpu())  # fmt: skip


@pytest.mark.parametrize("idx", range(len(SPECS)))
def test_features_fuzz_against_reference(idx):
    layer = SPECS[idx]
    rng = random.Random(idx)
    dtype = (torch.bfloat16, torch.float16)[idx % 2]
    page_size = rng.choice((8, 16, 24, 64, 128))
    kernel = get_decode_kernel(layer, dtype=dtype, page_size=page_size)
    failures = []
    for c in range(8):
        lens = [rng.choice((1, rng.randint(1, 70), rng.randint(1, 3000))) for _ in range(rng.randint(1, 3))]
        p = DecodeProblem(layer, lens, page_size, seed=100 * idx + c, dtype=dtype, device="cuda",
                          scale=rng.choice((None, 0.3)))  # fmt: skip
        sinks = (3 * torch.randn(layer.num_heads, device="cuda")) if layer.learned_sinks else None
        ref = _reference(p, sinks)
        q, kc, vc, bt, sl, _, scale = p.args()
        s = layer.scale if scale is None and layer.scale is not None else scale
        s = s if s is not None else layer.head_dim**-0.5
        for name, splits, merge in (("auto", None, None), ("s1", 1, None), ("s5_fused", 5, "fused"),
                                    ("s7_separate", 7, "separate")):  # fmt: skip
            poison_next_alloc((len(lens), layer.num_heads, layer.head_dim))
            if splits is None:  # the public entry, its own split count
                out = sparsegen.paged_decode(*p.args(), impl="cuda", sinks=sinks)
            else:
                out = kernel.launch(q, kc, vc, bt, sl, s, splits=splits, merge=merge, sinks=sinks)
            torch.cuda.synchronize()
            wrong = row_mismatch(out, ref)
            if wrong:
                failures.append(f"{name}: {wrong}: {p.repro()}")
    assert not failures, "\n".join(failures)


def test_fused_and_separate_merges_agree_bitwise_with_sinks():
    layer = SPECS[0]
    p = DecodeProblem(layer, [3000, 77], 16, seed=9, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, _ = p.args()
    sinks = torch.randn(layer.num_heads, device="cuda")
    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16)
    a = kernel.launch(q, kc, vc, bt, sl, 0.125, splits=6, merge="fused", sinks=sinks)
    b = kernel.launch(q, kc, vc, bt, sl, 0.125, splits=6, merge="separate", sinks=sinks)
    assert torch.equal(a, b)
