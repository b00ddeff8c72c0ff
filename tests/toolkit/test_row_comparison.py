"""`assert_close_rows` catches mask bugs confined to one tile, one head or one page, which a single
error norm over the whole output lets through.

Each case injects a bug into the oracle's visibility mask (`reference.layer_visible`), computes
the "kernel" output with it in float32 from the bf16 inputs and rounds it to bf16 (a kernel's
rounding), and compares with the float64 oracle: the old global check (rel_err < 2e-2, the bf16
prefill and decode tolerance) passes, the per-row one fails, and the same output without the bug
passes the per-row one.
"""

from __future__ import annotations

import pytest
import torch

import sparsegen.reference as reference
from sparsegen import HeadSpec, LayerSpec
from sparsegen.testing import DecodeProblem, PrefillProblem, assert_close_rows, rel_err, row_errors

OLD_GLOBAL_TOL = 2e-2  # what the kernel tests allowed for bf16 prefill and for every decode


def _hiding(head: int, hidden):
    """layer_visible with `hidden(q_pos[:, None], k_pos[None, :])` masked off for one head."""
    visible = reference.layer_visible

    def buggy(layer, q_pos, k_pos):
        mask = visible(layer, q_pos, k_pos).clone()  # [H, n_q, n_k]
        mask[head] &= ~hidden(q_pos[:, None], k_pos[None, :])
        return mask

    return buggy


def _kernel_like(problem, monkeypatch, bug=None) -> torch.Tensor:
    """The oracle in float32 from the problem's inputs, rounded to its dtype; with `bug` in the mask."""
    with monkeypatch.context() as mp:
        if bug is not None:
            mp.setattr(reference, "layer_visible", bug)
        args = tuple(
            x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in problem.args()
        )
        run = reference.paged_decode if isinstance(problem, DecodeProblem) else reference.prefill
        return run(*args).to(problem.dtype)


def _phi3_like(heads: int, kv: int, block: int, local: int, stride: int) -> LayerSpec:
    return LayerSpec(
        heads,
        kv,
        64,
        tuple(
            HeadSpec(block_size=block, local_blocks=local, vert_stride=stride, vert_offset=h % stride)
            for h in range(heads)
        ),
    )


def _window_layer() -> LayerSpec:
    heads = (HeadSpec(block_size=32, sliding_window=256),) * 4 + (
        HeadSpec(block_size=32, local_blocks=3),
    ) * 12
    return LayerSpec(16, 4, 64, heads)


def _one_tile_bug():
    """Head 3 misses its local key block 110 for the 16 queries of block 111 (one BLOCK_M x BLOCK_N tile)."""
    p = PrefillProblem(_phi3_like(8, 2, 16, 2, 4), [2048], [2048], seed=1, dtype=torch.bfloat16)
    return p, _hiding(3, lambda q, k: (q >= 111 * 16) & (q < 112 * 16) & (k >= 110 * 16) & (k < 111 * 16))


def _one_head_bug():
    """Head 2's sliding window is one token short (an off-by-one at the window edge), every row."""
    p = PrefillProblem(_window_layer(), [1500], [1500], seed=2, dtype=torch.bfloat16)
    return p, _hiding(2, lambda q, k: k == q - 255)


def _one_page_bug():
    """Head 7 of sequence 2 skips the page holding its keys 1968..1983 (page size 16)."""
    lens = [1500, 777, 2001, 1234, 900, 1600, 1300, 1111]
    p = DecodeProblem(_phi3_like(32, 4, 16, 4, 8), lens, 16, seed=2, dtype=torch.bfloat16)
    return p, _hiding(7, lambda q, k: (q == 2000) & (k >= 1968) & (k < 1984))


@pytest.mark.parametrize("case", [_one_tile_bug, _one_head_bug, _one_page_bug], ids=["tile", "head", "page"])
def test_a_confined_mask_bug_fails_per_row_but_passed_the_global_norm(case, monkeypatch):
    problem, bug = case()
    oracle = problem.reference()  # float64
    clean = _kernel_like(problem, monkeypatch)
    broken = _kernel_like(problem, monkeypatch, bug)
    assert_close_rows(clean, oracle)  # the kernel's own rounding passes
    assert rel_err(broken, oracle) < OLD_GLOBAL_TOL  # the old check let the bug through
    assert row_errors(broken, oracle).max() > 0.1  # the rows it touches are far off
    with pytest.raises(AssertionError, match="rows over the per-row tolerance"):
        assert_close_rows(broken, oracle)


def test_nan_in_one_element_never_passes():
    ref = torch.randn(5, 4, 64, dtype=torch.float64)
    out = ref.half()
    out[2, 1, 7] = float("nan")
    with pytest.raises(AssertionError, match=r"1 of 20 rows .* worst rows \(2, 1\): inf"):
        assert_close_rows(out, ref)
    with pytest.raises(AssertionError, match="1 of 20 rows"):
        assert_close_rows(out, ref, tol=float("inf"))


def test_the_tolerance_follows_the_dtype():
    ref = torch.randn(64, 8, 128, dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert_close_rows(ref.to(dtype), ref)  # one rounding to the dtype passes
    with pytest.raises(AssertionError):
        assert_close_rows(ref.to(torch.float16), ref, dtype=torch.float32)  # fp16 rounding is no fp32 result
    off = ref.to(torch.bfloat16)
    off[9, 3] *= 1.05  # one (row, head) 5% off: inside bf16's old global norm, outside its per-row tolerance
    assert rel_err(off, ref) < 2e-2
    with pytest.raises(AssertionError, match=r"1 of 512 rows .* \(9, 3\)"):
        assert_close_rows(off, ref)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_rows(ref[:, :4].half(), ref)


def test_rows_below_the_dtypes_normal_range_are_judged_against_that_floor():
    """An fp16 row whose reference is ~1e-5 (subnormal in fp16) cannot hold 2^-8 relative
    precision; one rounding to fp16 passes, a real error at that scale still fails, and rows in
    the normal range keep their relative tolerance."""
    ref = torch.randn(4, 2, 144, dtype=torch.float64)
    ref[0, 1] *= 1e-5  # stored in fp16 subnormals
    assert row_errors(ref.to(torch.float16) * 1.0, ref)[0, 1] < 1e-3
    assert_close_rows(ref.to(torch.float16), ref)
    off = ref.to(torch.float16)
    off[0, 1] *= 3.0  # wrong by 200 % at the subnormal scale: still a failure
    with pytest.raises(AssertionError, match=r"\(0, 1\)"):
        assert_close_rows(off, ref)
    assert row_errors(ref.float(), ref)[0, 1] < 1e-6  # float32 holds 1e-5 rows normally
