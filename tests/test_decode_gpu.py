"""GPU tier for the CUDA paged decode kernel (`pytest -m gpu`), against sparsegen.reference.

Cases are drawn from a seeded RNG (not hypothesis) so that a few dozen kernels serve >= 300
cases: each (spec, dtype, page size) compiles once and then runs many shapes.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_decode_codegen import eight_class_hybrid_layer

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import InputError
from sparsegen.presets import blocksparse_heads
from sparsegen.testing import DecodeProblem, rel_err, sample_layer_spec

pytestmark = pytest.mark.gpu
TOL = 2e-2  # fp16/bf16 inputs vs float64 math land between 1e-3 and 1e-2


def _specs() -> list[LayerSpec]:
    rng = random.Random(1234)
    out = [
        LayerSpec(
            8, 2, 128, blocksparse_heads(8, block_size=64, local_blocks=16, vert_stride=8, total_heads=32)
        ),
        LayerSpec(4, 1, 64, (HeadSpec(block_size=16, sliding_window=300),) * 4),
        LayerSpec(2, 2, 96, (HeadSpec(dense=True),) * 2),
    ]
    for n in range(21):
        out.append(sample_layer_spec(rng, hybrid=bool(n % 2)))
    return out


SPECS = _specs()
CASES_PER_KERNEL = 13


def _poison(shape, device) -> None:
    """Leave NaNs in the allocator block the kernel's output will most likely reuse."""
    junk = torch.full(shape, float("nan"), device=device)
    del junk


@pytest.mark.parametrize("idx", range(len(SPECS)))
def test_fuzz_against_reference(idx):
    layer = SPECS[idx]
    rng = random.Random(idx)
    dtype = (torch.bfloat16, torch.float16)[idx % 2]
    page_size = rng.choice((8, 16, 32, 64, 128, 24))
    failures = []
    for c in range(CASES_PER_KERNEL):
        batch = rng.randint(1, 4)
        lens = [
            rng.choice((1, rng.randint(1, 64), rng.randint(1, 3000), 64 * rng.randint(1, 40)))
            for _ in range(batch)
        ]
        scale = rng.choice((None, 0.05, 1.0 / 128))
        p = DecodeProblem(
            layer, lens, page_size, seed=1000 * idx + c, dtype=dtype, device="cuda", scale=scale
        )
        _poison((batch, layer.num_heads, layer.head_dim), "cuda")
        out = sparsegen.paged_decode(*p.args(), impl="cuda")
        torch.cuda.synchronize()
        err = rel_err(out, p.reference())
        if not err < TOL:
            failures.append(f"rel_err {err:.3g}: {p.repro()}")
    assert not failures, "\n".join(failures)


LONG = [
    (LayerSpec(8, 2, 128, blocksparse_heads(8, block_size=64, local_blocks=16, vert_stride=8, total_heads=32)), 16),
    (LayerSpec(8, 1, 128, (HeadSpec(block_size=64, sliding_window=4096),) * 8), 64),
    (LayerSpec(4, 4, 64, (HeadSpec(dense=True), HeadSpec(block_size=32, local_blocks=4, vert_stride=16, vert_offset=3),
                          HeadSpec(block_size=16, sliding_window=1000), HeadSpec(block_size=128, local_blocks=2))), 128),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", range(len(LONG)))
def test_long_contexts(which, dtype):
    """Up to 128K tokens, checked against the reference in float32 on the GPU."""
    layer, page_size = LONG[which]
    lens = [131072, 40000] if which == 0 else [100003]
    p = DecodeProblem(layer, lens, page_size, seed=7 + which, dtype=dtype, device="cuda")
    _poison((len(lens), layer.num_heads, layer.head_dim), "cuda")
    out = sparsegen.paged_decode(*p.args(), impl="cuda")
    assert rel_err(out, p.reference(exact=False)) < TOL, p.repro()


def test_decode_equals_last_prefill_row():
    layer = SPECS[0]
    n, page_size = 3000, 16
    p = DecodeProblem(layer, [n], page_size, seed=5, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    q_full, k, v, cu, _ = p.as_prefill(0)
    try:
        ref = sparsegen.prefill(q_full, k, v, cu, cu, layer, scale, impl="triton")[-1]
        print("decode vs last row of the compiled Triton prefill")
    except (ImportError, sparsegen.ImplUnavailableError):  # the Triton prefill is not built yet
        ref = sparsegen.reference.prefill(q_full, k, v, cu, cu, layer, scale)[-1]
        print("Triton prefill unavailable: decode vs last row of reference.prefill")
    out = sparsegen.paged_decode(q, kc, vc, bt, sl, layer, scale, impl="cuda")[0]
    assert rel_err(out, ref) < TOL


def test_cuda_graph_capture_and_replay():
    layer = SPECS[0]
    p = DecodeProblem(layer, [20000, 5], 16, seed=11, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel(q, kc, vc, bt, sl, scale=scale)  # warm-up: module load outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernel(q, kc, vc, bt, sl, scale=scale)
    for trial in range(3):
        q.copy_(torch.randn_like(q))
        sl.copy_(torch.tensor([20000 - 997 * trial, 5 + trial], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = kernel(q, kc, vc, bt, sl, scale=scale)
        assert torch.equal(static_out, eager), f"replay {trial} differs from eager"


def test_checked_mode_catches_bad_page_and_unchecked_survives():
    layer = SPECS[0]
    p = DecodeProblem(layer, [300, 40], 16, seed=2, dtype=torch.float16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    bad = bt.clone()
    bad[0, 3] = kc.shape[0] + 1000
    bad[1, 0] = -7
    with pytest.raises(InputError, match="block_tables"):
        sparsegen.paged_decode(q, kc, vc, bad, sl, layer, scale, impl="cuda", check=True)
    out = sparsegen.paged_decode(q, kc, vc, bad, sl, layer, scale, impl="cuda")  # unchecked
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    good = sparsegen.paged_decode(q, kc, vc, bt, sl, layer, scale, impl="cuda")
    assert rel_err(good, p.reference()) < TOL


def test_custom_op_and_strided_q_on_gpu():
    import sparsegen.custom_ops as sgops

    layer = SPECS[3]
    p = DecodeProblem(layer, [777, 1, 64], 32, seed=3, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device="cuda")
    wide[..., : q.shape[2]] = q
    out = sgops.paged_decode(wide[..., : q.shape[2]], kc, vc, bt, sl, layer, scale)
    assert rel_err(out, p.reference()) < TOL


def test_launcher_rejects_bad_strides():
    layer = SPECS[0]
    p = DecodeProblem(layer, [50], 16, seed=1, dtype=torch.float16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    with pytest.raises(InputError, match="last"):
        sparsegen.paged_decode(
            q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, bt, sl, layer, impl="cuda"
        )


# Template variants the benchmark compares (decode.compile_variant): each must compute the same
# function as the default build, at the heuristic split and at explicit split counts.
VARIANT_KNOBS = [
    {"pipeline": 1, "min_blocks": 3, "q_smem": 1},
    {"pipeline": 0, "min_blocks": 5, "q_smem": 1},
    {"pipeline": 1, "min_blocks": 3, "q_smem": 0},
]


@pytest.mark.parametrize("knobs", VARIANT_KNOBS, ids=lambda k: "_".join(f"{a}{b}" for a, b in k.items()))
def test_template_variants_against_reference(knobs):
    from sparsegen.kernels.decode import compile_variant

    failures = []
    for idx in (0, 1, 2, 4, 7, 9, 12):
        layer = SPECS[idx]
        rng = random.Random(500 + idx)
        dtype = (torch.bfloat16, torch.float16)[idx % 2]
        page_size = rng.choice((8, 16, 32, 64, 128, 24))
        kernel = compile_variant(layer, dtype=dtype, page_size=page_size, **knobs)
        for c in range(3):
            lens = [
                rng.choice((1, rng.randint(1, 64), rng.randint(1, 5000))) for _ in range(rng.randint(1, 3))
            ]
            p = DecodeProblem(layer, lens, page_size, seed=77 * idx + c, dtype=dtype, device="cuda")
            q, kc, vc, bt, sl, _, scale = p.args()
            ref = p.reference()
            outs = {"heuristic": kernel(q, kc, vc, bt, sl, scale=scale)}
            for s in (1, 3, 17):
                _poison(q.shape, "cuda")
                outs[s] = kernel.launch(
                    q, kc, vc, bt, sl, 1.0 / layer.head_dim**0.5 if scale is None else scale, splits=s
                )
            torch.cuda.synchronize()
            for k, out in outs.items():
                err = rel_err(out, ref)
                if not err < TOL:
                    failures.append(f"splits {k}: rel_err {err:.3g}: {p.repro()}")
    assert not failures, "\n".join(failures)


def test_split_counts_agree_phi3small():
    """Any split count (more splits than 64-token chunks too: empty splits) gives the same answer."""
    layer = sparsegen.get_pattern("phi3small").layers[0]
    p = DecodeProblem(layer, [20000, 3000, 1, 130], 16, seed=21, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    scale = 1.0 / layer.head_dim**0.5
    ref = sparsegen.reference.paged_decode(q.float(), kc.float(), vc.float(), bt, sl, layer, scale)
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    for s in (1, 2, 5, 16, 64, 256):
        _poison(q.shape, "cuda")
        out = kernel.launch(q, kc, vc, bt, sl, scale, splits=s)
        torch.cuda.synchronize()
        assert rel_err(out, ref) < TOL, f"splits {s}"


def test_many_pattern_classes_on_gpu():
    """A hybrid layer whose 8 head groups all differ (8 pattern classes, GQA 4)."""
    layer = eight_class_hybrid_layer()
    p = DecodeProblem(layer, [2500, 17], 32, seed=4, dtype=torch.float16, device="cuda")
    out = sparsegen.paged_decode(*p.args(), impl="cuda")
    assert rel_err(out, p.reference()) < TOL
