"""GPU tier for the CUDA paged decode kernel (`pytest -m gpu`), against sparsegen.reference.

Cases are drawn from a seeded RNG (not hypothesis) so that a few dozen kernels serve >= 300
cases: each (spec, dtype, page size) compiles once and then runs many shapes.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.poison import poison_next_alloc
from helpers.specs import eight_class_hybrid_layer

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import InputError
from sparsegen.presets import blocksparse_heads
from sparsegen.runner.graph_capture import capture
from sparsegen.testing import (
    ROW_TOL,
    DecodeProblem,
    assert_close_rows,
    row_mismatch,
    sample_layer_spec,
)

pytestmark = pytest.mark.gpu


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
        poison_next_alloc((batch, layer.num_heads, layer.head_dim), "cuda")
        out = sparsegen.paged_decode(*p.args(), impl="cuda")
        torch.cuda.synchronize()
        wrong = row_mismatch(out, p.reference())
        if wrong:
            failures.append(f"{wrong}: {p.repro()}")
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
    poison_next_alloc((len(lens), layer.num_heads, layer.head_dim), "cuda")
    out = sparsegen.paged_decode(*p.args(), impl="cuda")
    assert_close_rows(out, p.reference(exact=False), context=p.repro())


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
    assert_close_rows(out, ref, tol=2 * ROW_TOL[torch.bfloat16])  # a bf16 kernel's row, or the oracle's


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
    with capture(graph):
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
    assert_close_rows(good, p.reference())


def test_custom_op_and_strided_q_on_gpu():
    import sparsegen.ops as sgops

    layer = SPECS[3]
    p = DecodeProblem(layer, [777, 1, 64], 32, seed=3, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device="cuda")
    wide[..., : q.shape[2]] = q
    out = sgops.paged_decode_op(wide[..., : q.shape[2]], kc, vc, bt, sl, layer, scale)
    assert_close_rows(out, p.reference())


def test_launcher_rejects_bad_strides():
    layer = SPECS[0]
    p = DecodeProblem(layer, [50], 16, seed=1, dtype=torch.float16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    with pytest.raises(InputError, match="last"):
        sparsegen.paged_decode(
            q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, bt, sl, layer, impl="cuda"
        )


# Template variants the benchmark compares (get_decode_kernel knobs): each must compute the same
# function as the default build, at the heuristic split and at explicit split counts.
VARIANT_KNOBS = [
    {"pipeline": 1, "min_blocks": 3, "q_smem": 1},
    {"pipeline": 0, "min_blocks": 5, "q_smem": 1},
    {"pipeline": 1, "min_blocks": 3, "q_smem": 0},
    {"fused_merge": 0},  # no in-kernel merge: every split count goes through the reduce kernel
    {"qk_accs": 1},  # the QK k-steps in one chain (the default before session 9)
    {"qk_accs": 4},
]


@pytest.mark.parametrize("knobs", VARIANT_KNOBS, ids=lambda k: "_".join(f"{a}{b}" for a, b in k.items()))
def test_template_variants_against_reference(knobs):
    from sparsegen.kernels.decode import get_decode_kernel

    failures = []
    for idx in (0, 1, 2, 4, 7, 9, 12):
        layer = SPECS[idx]
        rng = random.Random(500 + idx)
        dtype = (torch.bfloat16, torch.float16)[idx % 2]
        page_size = rng.choice((8, 16, 32, 64, 128, 24))
        kernel = get_decode_kernel(layer, dtype=dtype, page_size=page_size, knobs=knobs)
        for c in range(3):
            lens = [
                rng.choice((1, rng.randint(1, 64), rng.randint(1, 5000))) for _ in range(rng.randint(1, 3))
            ]
            p = DecodeProblem(layer, lens, page_size, seed=77 * idx + c, dtype=dtype, device="cuda")
            q, kc, vc, bt, sl, _, scale = p.args()
            ref = p.reference()
            outs = {"heuristic": kernel(q, kc, vc, bt, sl, scale=scale)}
            for s in (1, 3, 17):
                poison_next_alloc(q.shape, "cuda")
                outs[s] = kernel.launch(
                    q, kc, vc, bt, sl, 1.0 / layer.head_dim**0.5 if scale is None else scale, splits=s
                )
            torch.cuda.synchronize()
            for k, out in outs.items():
                wrong = row_mismatch(out, ref)
                if wrong:
                    failures.append(f"splits {k}: {wrong}: {p.repro()}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("idx", [0, 1, 2, 3, 6, 9, 14])
def test_head_major_pages_equal_token_major(idx):
    """The engine's head-major KV pages ([pages, Hkv, page, D] seen through .transpose(1, 2)) give
    bitwise the output of the same values in token-major pages, at several split counts; both
    against the reference, with NaN-poisoned outputs."""
    layer = SPECS[idx]
    rng = random.Random(900 + idx)
    dtype = (torch.bfloat16, torch.float16)[idx % 2]
    page_size = rng.choice((8, 16, 32, 24, 128))
    kernel = sparsegen.get_kernel(layer, "decode", dtype=dtype, page_size=page_size)
    lens = [rng.choice((1, rng.randint(2, 300), rng.randint(1000, 9000))) for _ in range(rng.randint(1, 4))]
    p = DecodeProblem(layer, lens, page_size, seed=31 * idx, dtype=dtype, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    scale = 1.0 / layer.head_dim**0.5 if scale is None else scale
    heads = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc)]  # same view, head-major
    assert heads[0].stride(1) == layer.head_dim and torch.equal(heads[0], kc)
    ref = p.reference()
    for s in (None, 1, 3, 16):
        poison_next_alloc(q.shape, "cuda")
        token = kernel.launch(q, kc, vc, bt, sl, scale, splits=s)
        poison_next_alloc(q.shape, "cuda")
        head = kernel.launch(q, *heads, bt, sl, scale, splits=s)
        torch.cuda.synchronize()
        assert torch.equal(head, token), f"splits {s}: {p.repro()}"
        assert_close_rows(head, ref, context=f"splits {s}: {p.repro()}")
    assert torch.equal(sparsegen.paged_decode(q, *heads, bt, sl, layer, scale=scale), kernel(q, kc, vc, bt, sl,
                       scale=scale))  # fmt: skip


@pytest.mark.parametrize("splits", [1, 2, 48])  # no merge, the in-kernel merge, the reduce kernel
def test_pdl_launch_waits_for_the_kernel_that_writes_q(splits):
    """pdl=True (programmatic dependent launch): in a CUDA graph, each decode launch follows the
    kernel that writes its q (and the new token's K/V row): it must see this replay's values,
    bitwise the plain launch's output, with NaN-poisoned outputs."""
    from sparsegen import env

    if not env.supports_pdl():
        pytest.skip("programmatic dependent launch needs sm_90")
    layer = sparsegen.get_pattern("phi3small").layers[0]
    p = DecodeProblem(layer, [8200, 700, 3000], 16, seed=5, dtype=torch.bfloat16, device="cuda")
    q0, kc, vc, bt, sl, _, scale = p.args()
    scale = 1.0 / layer.head_dim**0.5 if scale is None else scale
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    qs = [torch.randn_like(q0) for _ in range(3)]  # each replay's q: [B, H, D]
    q_in, q_buf = torch.empty_like(q0), torch.empty_like(q0)
    # the newest token's K row of sequence 0, written by the same kernel as q
    last = (bt[0, (int(sl[0]) - 1) // 16].item(), (int(sl[0]) - 1) % 16)
    k_new = [torch.randn_like(kc[last]) for _ in range(3)]  # [Hkv, D]
    k_in = torch.empty_like(k_new[0])
    outs = {}
    for pdl in (False, True):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch._foreach_copy_([q_buf, kc[last]], [q_in, k_in])  # warm-up outside the capture
            kernel.launch(q_buf, kc, vc, bt, sl, scale, splits=splits, pdl=pdl)
            with capture(graph, stream=stream):
                # one kernel writes q and the new token's K, as the rotary kernel does
                torch._foreach_copy_([q_buf, kc[last]], [q_in, k_in])
                out = kernel.launch(q_buf, kc, vc, bt, sl, scale, splits=splits, pdl=pdl)
        outs[pdl] = []
        for i in range(3):
            q_in.copy_(qs[i])
            k_in.copy_(k_new[i])
            poison_next_alloc(q0.shape, "cuda")
            graph.replay()
            torch.cuda.synchronize()
            outs[pdl].append(out.clone())
            kc_i = kc.clone()
            want = sparsegen.reference.paged_decode(
                qs[i].float(), kc_i.float(), vc.float(), bt, sl, layer, scale
            )
            assert_close_rows(out, want, context=f"pdl={pdl} replay {i}")
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    # the same flag through the kernel's call and the public function (eager launches)
    plain = kernel(q_buf, kc, vc, bt, sl, scale=scale)
    assert torch.equal(kernel(q_buf, kc, vc, bt, sl, scale=scale, pdl=True), plain)
    assert torch.equal(sparsegen.paged_decode(q_buf, kc, vc, bt, sl, layer, scale=scale, pdl=True), plain)


def test_split_counts_agree_phi3small():
    """Any split count (more splits than 64-token chunks too: empty splits) gives the same answer."""
    layer = sparsegen.get_pattern("phi3small").layers[0]
    p = DecodeProblem(layer, [20000, 3000, 1, 130], 16, seed=21, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    scale = 1.0 / layer.head_dim**0.5
    ref = sparsegen.reference.paged_decode(q.float(), kc.float(), vc.float(), bt, sl, layer, scale)
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    for s in (1, 2, 5, 16, 64, 256):
        poison_next_alloc(q.shape, "cuda")
        out = kernel.launch(q, kc, vc, bt, sl, scale, splits=s)
        torch.cuda.synchronize()
        assert_close_rows(out, ref, context=f"splits {s}")


def test_many_pattern_classes_on_gpu():
    """A hybrid layer whose 8 head groups all differ (8 pattern classes, GQA 4)."""
    layer = eight_class_hybrid_layer()
    p = DecodeProblem(layer, [2500, 17], 32, seed=4, dtype=torch.float16, device="cuda")
    out = sparsegen.paged_decode(*p.args(), impl="cuda")
    assert_close_rows(out, p.reference())


# ---- split-KV merges: in-kernel ("fused", the last block of a head group merges) vs the separate
# reduce kernel (kernels/decode_merge.py). The two add in the same order (paged_decode_reduce.cuh),
# so they are compared BITWISE (torch.equal); each is also checked against the reference.
MERGE_SPLITS = (2, 3, 7, 48)


def _scale(layer, scale):
    return 1.0 / layer.head_dim**0.5 if scale is None else scale


def _heuristic(kernel, q, block_tables, page_size) -> int:
    from sparsegen.kernels.families.decode import _sm_count, num_splits

    rows = q.shape[0] * q.shape[1] // kernel.heads_per_block
    return num_splits(rows, block_tables.shape[1] * page_size, _sm_count(q.device))


def _both_merges(kernel, args, scale, splits):
    """(fused, separate) outputs of one split count, each into a NaN-poisoned allocation."""
    q, kc, vc, bt, sl = args
    outs = []
    for merge in ("fused", "separate"):
        junk = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")  # the output's size class
        del junk
        outs.append(kernel.launch(q, kc, vc, bt, sl, scale, splits=splits, merge=merge))
    torch.cuda.synchronize()
    return outs


def _check_merges(kernel, p, splits_list, failures, args=None):
    q, kc, vc, bt, sl, _, scale = p.args()
    args = (q, kc, vc, bt, sl) if args is None else args
    ref = p.reference()
    for s in splits_list:
        fused, separate = _both_merges(kernel, args, _scale(p.layer, scale), s)
        wrong = row_mismatch(fused, ref)
        if wrong:
            failures.append(f"splits {s} fused: {wrong}: {p.repro()}")
        if not torch.equal(fused, separate):
            diff = (fused.float() - separate.float()).abs().max().item()
            failures.append(f"splits {s}: fused != separate bitwise (max |diff| {diff:.3g}): {p.repro()}")


@pytest.mark.parametrize("idx", (0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23))
def test_merge_fused_fuzz_against_reference_and_separate(idx):
    layer = SPECS[idx]
    rng = random.Random(9000 + idx)
    dtype = (torch.bfloat16, torch.float16)[idx % 2]
    page_size = rng.choice((8, 16, 32, 64, 128, 24))
    kernel = sparsegen.get_kernel(layer, "decode", dtype=dtype, page_size=page_size)
    failures = []
    for c in range(4):
        lens = [rng.choice((1, rng.randint(1, 64), rng.randint(1, 4000), 64 * rng.randint(1, 60)))
                for _ in range(rng.randint(1, 4))]  # fmt: skip
        p = DecodeProblem(layer, lens, page_size, seed=31 * idx + c, dtype=dtype, device="cuda",
                          scale=rng.choice((None, 0.05)))  # fmt: skip
        q, _, _, bt, *_ = p.args()
        _check_merges(kernel, p, (*MERGE_SPLITS, max(2, _heuristic(kernel, q, bt, page_size))), failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("which", ("sparse", "dense"))
def test_merge_phi3small_1x8k_heuristic(which):
    """The heuristic's pick at 1 x 8K (48 splits), both merges, and the rule's own choice."""
    layer = sparsegen.get_pattern("phi3small").layers[0 if which == "sparse" else 1]
    p = DecodeProblem(layer, [8192], 16, seed=8, dtype=torch.bfloat16, device="cuda", spare_pages=0)
    q, kc, vc, bt, sl, _, scale = p.args()
    bt = bt[:, :512].contiguous()  # the engine's 8K table: 512 pages
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    assert _heuristic(kernel, q, bt, 16) == 48
    failures = []
    _check_merges(kernel, p, (48, 32, 64), failures, args=(q, kc, vc, bt, sl))
    poison_next_alloc(q.shape, "cuda")
    ruled = kernel(q, kc, vc, bt, sl, scale=scale)  # heuristic split, rule's merge
    torch.cuda.synchronize()
    assert_close_rows(ruled, p.reference())
    assert not failures, "\n".join(failures)


def test_merge_splits_without_visible_keys():
    """Splits that see no key (far splits of window-only heads, more splits than chunks, a
    1-token sequence) merge to the same answer: their (m, l) = (-inf, 0) weigh nothing."""
    window = LayerSpec(8, 2, 128, (HeadSpec(block_size=16, sliding_window=40),) * 8)
    phi3 = sparsegen.get_pattern("phi3small").layers[0]
    failures = []
    for layer, lens, dtype in (
        (window, [5000, 64, 1], torch.float16),
        (window, [1, 2, 17], torch.bfloat16),
        (phi3, [1, 2, 70], torch.bfloat16),
    ):
        p = DecodeProblem(layer, lens, 16, seed=len(lens) + lens[0], dtype=dtype, device="cuda")
        kernel = sparsegen.get_kernel(layer, "decode", dtype=dtype, page_size=16)
        _check_merges(kernel, p, (2, 7, 48, 256), failures)
    assert not failures, "\n".join(failures)


def test_merge_mixed_lengths_wide_table():
    """A batch of mixed lengths in a table far wider than any of them (as a CUDA-graph bucket is);
    the extra columns hold valid page ids that must not be read."""
    layer = sparsegen.get_pattern("phi3small").layers[0]
    p = DecodeProblem(layer, [1, 63, 1000, 8191, 130], 16, seed=12, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    extra = torch.randint(0, kc.shape[0], (bt.shape[0], 1024 - bt.shape[1]), dtype=torch.int32, device="cuda")
    wide = torch.cat([bt, extra], dim=1).contiguous()  # [B, 1024]
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    failures = []
    _check_merges(kernel, p, (*MERGE_SPLITS, max(2, _heuristic(kernel, q, wide, 16))), failures,
                  args=(q, kc, vc, wide, sl))  # fmt: skip
    assert not failures, "\n".join(failures)


def _merge_setup():
    from sparsegen.kernels.decode_merge import COUNTERS

    layer = sparsegen.get_pattern("phi3small").layers[0]
    p = DecodeProblem(layer, [20000, 5, 3000, 1], 16, seed=13, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, _ = p.args()
    kernel = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    rows = q.shape[0] * q.shape[1] // kernel.heads_per_block
    return COUNTERS, kernel, (q, kc, vc, bt, sl), rows


def test_merge_fused_back_to_back_launches_reset_counters():
    """100 fused launches in a row, split counts changing, no sync between: each equals the
    separate merge bitwise (a counter left non-zero would make a later launch merge early or
    never), and the stream's counters are all zero afterwards."""
    counters, kernel, args, rows = _merge_setup()
    scale = 1 / 128
    expected = {s: kernel.launch(*args, scale, splits=s, merge="separate") for s in (2, 7, 17, 48)}
    outs = []
    for i in range(100):
        s = (2, 7, 17, 48)[i % 4]
        outs.append((s, kernel.launch(*args, scale, splits=s, merge="fused")))
    torch.cuda.synchronize()
    bad = [i for i, (s, o) in enumerate(outs) if not torch.equal(o, expected[s])]
    assert not bad, f"launches {bad} differ from the separate merge"
    stream = torch.cuda.current_stream().cuda_stream
    assert not counters.get(args[0].device, stream, rows)[:rows].any()


def test_merge_fused_cuda_graph_replays():
    """A graph of fused launches (3 split counts), replayed 50 times with new q and lengths each
    time: every replay equals eager separate merges bitwise; the capture stream's counters end at 0."""
    counters, kernel, args, rows = _merge_setup()
    q, kc, vc, bt, sl = args
    scale = 1 / 128
    splits = (2, 7, 48)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in splits:
            kernel.launch(*args, scale, splits=s, merge="fused")  # module load outside the capture
    torch.cuda.current_stream().wait_stream(side)
    capture_stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with capture(graph, stream=capture_stream):
        static = [kernel.launch(*args, scale, splits=s, merge="fused") for s in splits]
    gen = torch.Generator(device="cuda").manual_seed(3)
    failures = []
    for r in range(50):
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=q.dtype))
        sl.copy_(torch.tensor([20000 - 97 * r, 1 + r % 16, 3000 - r, 1 + r % 16], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for s, out in zip(splits, static):
            if not torch.equal(out, kernel.launch(*args, scale, splits=s, merge="separate")):
                failures.append(f"replay {r}, splits {s}")
    assert not failures, failures
    torch.cuda.synchronize()
    assert not counters.get(q.device, capture_stream.cuda_stream, rows)[:rows].any()


def test_merge_fused_on_two_streams_at_once():
    """Fused launches in flight on two streams at once use separate counters (one per stream)."""
    _, kernel, args, _ = _merge_setup()
    layer = SPECS[0]
    p2 = DecodeProblem(layer, [7000, 300], 16, seed=14, dtype=torch.bfloat16, device="cuda")
    q2, kc2, vc2, bt2, sl2, _, _ = p2.args()
    k2 = sparsegen.get_kernel(layer, "decode", dtype=torch.bfloat16, page_size=16)
    e1 = kernel.launch(*args, 1 / 128, splits=48, merge="separate")
    e2 = k2.launch(q2, kc2, vc2, bt2, sl2, 1 / 128, splits=48, merge="separate")
    torch.cuda.synchronize()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    outs = ([], [])
    for _ in range(30):
        with torch.cuda.stream(streams[0]):
            outs[0].append(kernel.launch(*args, 1 / 128, splits=48, merge="fused"))
        with torch.cuda.stream(streams[1]):
            outs[1].append(k2.launch(q2, kc2, vc2, bt2, sl2, 1 / 128, splits=48, merge="fused"))
    torch.cuda.synchronize()
    assert all(torch.equal(o, e1) for o in outs[0]) and all(torch.equal(o, e2) for o in outs[1])
