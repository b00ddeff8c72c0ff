"""GPU tier (`pytest -m gpu`): the CUDA decode kernel over fp8 (e4m3, e5m2) K/V pages against
sparsegen.reference on the same fp8 bytes and scales, per (row, head), on fuzzed specs (every
feature, head dims 32..256, GQA groups sharing pages), per-KV-head and per-tensor scales,
NaN-poisoned outputs and unused pages, unsplit and split (fused and separate merges); on N(0, 1)
data the fp8 output is within 6e-2 (relative) of attention over the unquantised K/V; and a
CUDA graph replays with the scale tensors' current values."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers.poison import poison_next_alloc

import sparsegen
from sparsegen import HeadSpec, LayerSpec, reference
from sparsegen.errors import InputError
from sparsegen.kernels.decode import get_decode_kernel
from sparsegen.testing import DecodeProblem, row_mismatch, sample_layer_spec

pytestmark = pytest.mark.gpu

HEAD_DIMS = tuple(range(32, 257, 16))
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _with_features(rng: random.Random, layer: LayerSpec) -> LayerSpec:
    n = rng.choice((0, 1, 4, 64, 100))
    heads = tuple(
        h if h.dense or rng.random() < 0.3 else dataclasses.replace(h, sink_tokens=n) for h in layer.heads
    )
    return dataclasses.replace(layer, heads=heads, logit_softcap=rng.choice((0.0, 0.0, 30.0)),
                               learned_sinks=rng.random() < 0.4)  # fmt: skip


def _specs() -> list[LayerSpec]:
    rng = random.Random(3030)
    out = [
        sparsegen.get_pattern("phi3small").layers[0],
        sparsegen.get_pattern("phi3small").layers[1],
        LayerSpec(8, 1, 64, (HeadSpec(block_size=16, sliding_window=128),) * 8, learned_sinks=True),
        LayerSpec(2, 1, 256, (HeadSpec(block_size=64, sliding_window=4096),) * 2, logit_softcap=50.0),
    ]
    for n in range(16):
        out.append(_with_features(rng, sample_layer_spec(rng, hybrid=bool(n % 2), head_dims=HEAD_DIMS)))
    return out


SPECS = _specs()


def _scales(rng: random.Random, hkv: int, per_head: bool, amax: float, fp8) -> torch.Tensor:
    """Scales near amax / fp8 max (so the quantised values fill the range), varied per head."""
    top = torch.finfo(fp8).max
    vals = [amax / top * rng.uniform(0.5, 2.0) for _ in range(hkv if per_head else 1)]
    t = torch.tensor(vals, dtype=torch.float32, device="cuda")
    return t if per_head else t.reshape(())


def _quantize(x: torch.Tensor, scale: torch.Tensor, fp8) -> torch.Tensor:
    """x: [pages, ps, Hkv, D] -> fp8 of x / scale, saturated (never NaN)."""
    s = scale[:, None] if scale.dim() else scale
    top = torch.finfo(fp8).max
    return (x.float() / s).clamp(-top, top).to(fp8)


def _fp8_problem(p: DecodeProblem, rng: random.Random, fp8, per_head: bool):
    q, kc, vc, bt, sl, layer, scale = p.args()
    hkv = layer.num_kv_heads
    ks, vs = _scales(rng, hkv, per_head, 4.0, fp8), _scales(rng, hkv, per_head, 4.0, fp8)
    k8, v8 = _quantize(kc, ks, fp8), _quantize(vc, vs, fp8)
    used = set(bt[bt >= 0].tolist())
    spare = torch.tensor([i for i in range(k8.shape[0]) if i not in used], dtype=torch.long, device="cuda")
    for cache in (k8, v8):  # pages no table holds: NaN (byte 0x7f in e4m3 and e5m2), so a read shows
        cache.view(torch.uint8)[spare] = 0x7F
    return q, k8, v8, bt, sl, layer, scale, ks, vs


def _reference(q, k8, v8, bt, sl, layer, scale, ks, vs, sinks) -> torch.Tensor:
    return reference.paged_decode(q.cpu().double(), k8.cpu(), v8.cpu(), bt.cpu(), sl.cpu(), layer, scale,
                                  sinks=None if sinks is None else sinks.cpu(), k_scale=ks.cpu(),
                                  v_scale=vs.cpu())  # fmt: skip


@pytest.mark.parametrize("idx", range(len(SPECS)))
def test_fp8_fuzz_against_reference_on_the_same_bytes(idx):
    layer = SPECS[idx]
    rng = random.Random(idx)
    dtype = (torch.bfloat16, torch.float16)[idx % 2]
    fp8 = FP8[(idx // 2) % 2]
    page_size = rng.choice((8, 16, 24, 64, 128))
    kernel = get_decode_kernel(layer, dtype=dtype, page_size=page_size, kv_dtype=fp8)
    assert "_kvfp8e" in kernel.name
    failures = []
    for c in range(6):
        lens = [rng.choice((1, rng.randint(1, 70), rng.randint(1, 3000))) for _ in range(rng.randint(1, 3))]
        p = DecodeProblem(layer, lens, page_size, seed=100 * idx + c, dtype=dtype, device="cuda",
                          scale=rng.choice((None, 0.3)))  # fmt: skip
        q, k8, v8, bt, sl, _, scale, ks, vs = _fp8_problem(p, rng, fp8, per_head=c % 3 != 2)
        sinks = (3 * torch.randn(layer.num_heads, device="cuda")) if layer.learned_sinks else None
        ref = _reference(q, k8, v8, bt, sl, layer, scale, ks, vs, sinks)
        s = layer.scale if scale is None and layer.scale is not None else scale
        s = s if s is not None else layer.head_dim**-0.5
        for name, splits, merge in (("auto", None, None), ("s1", 1, None), ("s5_fused", 5, "fused"),
                                    ("s7_separate", 7, "separate")):  # fmt: skip
            poison_next_alloc((len(lens), layer.num_heads, layer.head_dim))
            if splits is None:  # the public entry, its own split count
                out = sparsegen.paged_decode(q, k8, v8, bt, sl, layer, scale, impl="cuda", sinks=sinks,
                                             k_scale=ks, v_scale=vs)  # fmt: skip
            else:
                out = kernel.launch(q, k8, v8, bt, sl, s, splits=splits, merge=merge, sinks=sinks, k_scale=ks,
                                    v_scale=vs)  # fmt: skip
            torch.cuda.synchronize()
            wrong = row_mismatch(out, ref)
            if wrong:
                failures.append(f"{name} {fp8} per_head={ks.dim() == 1}: {wrong}: {p.repro()}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("layer_idx", [0, 1])
@pytest.mark.parametrize("splits", [1, 6])
def test_fp8_e4m3_on_gaussian_data_is_close_to_unquantised_attention(layer_idx, splits):
    """N(0, 1) K/V, per-head scales amax / 448: the fp8 kernel's output is within 6e-2 (relative,
    per row and head) of the float64 reference over the unquantised K/V."""
    layer = SPECS[layer_idx]
    p = DecodeProblem(layer, [8192, 3000, 517, 64], 16, seed=7, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, _ = p.args()
    top = torch.finfo(torch.float8_e4m3fn).max
    ks = (kc.float().abs().amax(dim=(0, 1, 3)) / top).contiguous()  # [Hkv]
    vs = (vc.float().abs().amax(dim=(0, 1, 3)) / top).contiguous()
    k8, v8 = _quantize(kc, ks, torch.float8_e4m3fn), _quantize(vc, vs, torch.float8_e4m3fn)
    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16, kv_dtype=torch.float8_e4m3fn)
    poison_next_alloc((4, layer.num_heads, layer.head_dim))
    out = kernel.launch(q, k8, v8, bt, sl, layer.head_dim**-0.5, splits=splits, k_scale=ks, v_scale=vs)
    exact = p.reference()  # float64 over the bf16 K/V, never quantised
    wrong = row_mismatch(out, exact, tol=6e-2)
    assert wrong is None, wrong


def test_graph_replay_reads_the_scales_current_values():
    """The scales are device tensors the kernel reads: a captured graph replays with the values
    they hold at replay (the engine calibrates in place after capture)."""
    layer = SPECS[0]
    rng = random.Random(1)
    p = DecodeProblem(layer, [700, 33], 16, seed=3, dtype=torch.bfloat16, device="cuda")
    q, k8, v8, bt, sl, _, _, ks, vs = _fp8_problem(p, rng, torch.float8_e4m3fn, per_head=True)
    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16, kv_dtype=torch.float8_e4m3fn)
    kernel.launch(q, k8, v8, bt, sl, 0.1, k_scale=ks, v_scale=vs)  # warm (module load) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.launch(q, k8, v8, bt, sl, 0.1, k_scale=ks, v_scale=vs)
    ks.mul_(1.7)
    vs.mul_(0.6)
    graph.replay()
    torch.cuda.synchronize()
    eager = kernel.launch(q, k8, v8, bt, sl, 0.1, k_scale=ks, v_scale=vs)
    assert torch.equal(out, eager)
    ref = reference.paged_decode(q.cpu().double(), k8.cpu(), v8.cpu(), bt.cpu(), sl.cpu(), layer, 0.1,
                                 k_scale=ks.cpu(), v_scale=vs.cpu())  # fmt: skip
    assert row_mismatch(out, ref) is None


def test_fp8_fused_and_separate_merges_agree_bitwise():
    layer = SPECS[2]
    rng = random.Random(4)
    p = DecodeProblem(layer, [3000, 77], 16, seed=9, dtype=torch.bfloat16, device="cuda")
    q, k8, v8, bt, sl, _, _, ks, vs = _fp8_problem(p, rng, torch.float8_e4m3fn, per_head=False)
    sinks = torch.randn(layer.num_heads, device="cuda")
    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16, kv_dtype="fp8")
    a = kernel.launch(q, k8, v8, bt, sl, 0.125, splits=6, merge="fused", sinks=sinks, k_scale=ks, v_scale=vs)
    b = kernel.launch(
        q, k8, v8, bt, sl, 0.125, splits=6, merge="separate", sinks=sinks, k_scale=ks, v_scale=vs
    )
    assert torch.equal(a, b)


def test_scales_on_another_device_are_refused():
    layer = SPECS[0]
    rng = random.Random(5)
    p = DecodeProblem(layer, [100], 16, seed=2, dtype=torch.bfloat16, device="cuda")
    q, k8, v8, bt, sl, _, _, ks, vs = _fp8_problem(p, rng, torch.float8_e4m3fn, per_head=True)
    kernel = get_decode_kernel(layer, dtype=torch.bfloat16, page_size=16, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(InputError, match="k_scale is on cpu but q is on cuda"):
        kernel.launch(q, k8, v8, bt, sl, 0.1, k_scale=ks.cpu(), v_scale=vs)
    with pytest.raises(InputError, match="v_scale is on cpu but q is on cuda"):
        sparsegen.paged_decode(q, k8, v8, bt, sl, layer, impl="cuda", k_scale=ks, v_scale=vs.cpu())
    with pytest.raises(InputError, match="pass k_scale="):
        sparsegen.paged_decode(q, k8, v8, bt, sl, layer, impl="cuda")
