"""The oracle itself: against naive float64 math and DESIGN §6's metamorphic relations."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.specs import sees
from hypothesis import given
from hypothesis import strategies as st

import sparsegen as sg
from sparsegen import HeadSpec, InputError, LayerSpec, ops, presets, reference
from sparsegen.testing import DecodeProblem, decode_problems, layer_specs, prefill_problems, rel_err


def naive_prefill(problem) -> torch.Tensor:
    """Independent float64 attention: one explicit mask per sequence from the literal rule."""
    t = {n: x.double() if x.is_floating_point() else x for n, x in problem.tensors.items()}
    layer, out = problem.layer, []
    scale = problem.scale if problem.scale is not None else 1 / math.sqrt(layer.head_dim)
    cq, ck = t["cu_seqlens_q"].tolist(), t["cu_seqlens_k"].tolist()
    for b in range(len(cq) - 1):
        q, k, v = t["q"][cq[b] : cq[b + 1]], t["k"][ck[b] : ck[b + 1]], t["v"][ck[b] : ck[b + 1]]
        n_q, n_k = q.shape[0], k.shape[0]
        rows = []
        for h in range(layer.num_heads):
            g = layer.kv_head(h)
            mask = torch.tensor(
                [[sees(layer.heads[h], n_k - n_q + r, j) for j in range(n_k)] for r in range(n_q)],
                dtype=torch.bool,
            ).reshape(n_q, n_k)
            s = (q[:, h] @ k[:, g].T * scale).masked_fill(~mask, -math.inf)
            rows.append(torch.softmax(s, -1) @ v[:, g])
        out.append(torch.stack(rows, 1))
    return torch.cat(out)


@given(prefill_problems(layer_specs(max_kv_heads=2, gqa_ratios=(1, 2, 4)), max_len=120, dtype=torch.float32))
@pytest.mark.slow
def test_reference_matches_naive_float64(problem):
    out = reference.prefill(*problem.args())
    assert out.dtype == torch.float32
    assert rel_err(out, naive_prefill(problem)) < 1e-5, problem.repro()


@given(prefill_problems(max_len=200, dtype=torch.float64))
@pytest.mark.slow
def test_prefill_chunks_equal_whole(problem):
    """Prefix + chunk: attention over the last queries equals those rows of the whole prefill."""
    layer, t = problem.layer, problem.tensors
    n = problem.k_lens[0]
    k, v = t["k"][:n], t["v"][:n]
    q = torch.randn(n, layer.num_heads, layer.head_dim, dtype=torch.float64)
    whole = reference.prefill(q, k, v, *(torch.tensor([0, n], dtype=torch.int32),) * 2, layer)
    split = n // 2
    cu_q = torch.tensor([0, n - split], dtype=torch.int32)
    tail = reference.prefill(q[split:], k, v, cu_q, torch.tensor([0, n], dtype=torch.int32), layer)
    assert rel_err(tail, whole[split:]) < 1e-12


def _one_seq(n_q, n_k):
    return torch.tensor([0, n_q], dtype=torch.int32), torch.tensor([0, n_k], dtype=torch.int32)


@pytest.mark.parametrize("n, hkv, group", [(1, 1, 1), (77, 2, 4), (300, 1, 8)])
def test_dense_equals_causal_sdpa(n, hkv, group):
    h = hkv * group
    layer = LayerSpec(num_heads=h, num_kv_heads=hkv, head_dim=64, heads=(HeadSpec(dense=True),) * h)
    q = torch.randn(n, h, 64, dtype=torch.float64)
    k, v = torch.randn(n, hkv, 64, dtype=torch.float64), torch.randn(n, hkv, 64, dtype=torch.float64)
    out = reference.prefill(q, k, v, *_one_seq(n, n), layer)
    kk, vv = (x.repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
    assert rel_err(out, sdpa.transpose(0, 1)) < 1e-10


@given(st.integers(1, 300), st.integers(1, 80))
def test_sliding_window_equals_sliced_keys(n, window):
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(sliding_window=window),) * 2)
    dense = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(dense=True),) * 2)
    q = torch.randn(n, 2, 64, dtype=torch.float64)
    k, v = torch.randn(n, 1, 64, dtype=torch.float64), torch.randn(n, 1, 64, dtype=torch.float64)
    out = reference.prefill(q, k, v, *_one_seq(n, n), layer)
    for i in (0, n // 2, n - 1):
        lo = max(0, i - window + 1)
        one = reference.prefill(q[i : i + 1], k[lo : i + 1], v[lo : i + 1], *_one_seq(1, i + 1 - lo), dense)
        assert rel_err(out[i : i + 1], one) < 1e-10


def test_homo_head_equals_identical_heads():
    homo = presets.blocksparse_heads(8, block_size=16, local_blocks=2, vert_stride=4, homo_head=True)
    layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64, heads=homo)
    single = LayerSpec(num_heads=1, num_kv_heads=1, head_dim=64, heads=(homo[0],))
    n = 150
    q, k, v = torch.randn(n, 8, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
    out = reference.prefill(q, k, v, *_one_seq(n, n), layer)
    for h in range(8):
        g = h // 4
        one = reference.prefill(q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], *_one_seq(n, n), single)
        assert rel_err(out[:, h : h + 1], one) < 1e-6


@given(decode_problems(max_len=500, dtype=torch.float64))
@pytest.mark.slow
def test_decode_is_last_prefill_row_and_paged_equals_contiguous(problem):
    layer, t = problem.layer, problem.tensors
    decoded = reference.paged_decode(*problem.args())
    page = problem.page_size
    for b, n in enumerate(problem.seq_lens):
        pages = t["block_tables"][b, : -(-n // page)].long()
        k = t["k_cache"][pages].flatten(0, 1)[:n]
        v = t["v_cache"][pages].flatten(0, 1)[:n]
        row = reference.prefill(t["q"][b : b + 1], k, v, *_one_seq(1, n), layer, problem.scale)
        assert rel_err(decoded[b : b + 1], row) < 1e-12


@pytest.mark.slow
def test_reference_never_builds_a_full_mask(monkeypatch):
    """The chunked loop keeps every score tensor under the budget, whatever the length."""
    seen = []
    real = reference.layer_visible

    def spy(layer, q_pos, k_pos):
        seen.append(q_pos.numel() * k_pos.numel() * layer.num_heads)
        return real(layer, q_pos, k_pos)

    monkeypatch.setattr(reference, "layer_visible", spy)
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 1 << 16)
    layer = sg.get_pattern("phi3small").layers[0]
    layer = LayerSpec(num_heads=32, num_kv_heads=8, head_dim=64, heads=layer.heads)
    n = 2048
    reference.prefill(
        torch.randn(n, 32, 64), torch.randn(n, 8, 64), torch.randn(n, 8, 64), *_one_seq(n, n), layer
    )
    assert max(seen) <= 1 << 16 and len(seen) > 1


def test_reference_input_errors():
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(dense=True),) * 2)
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(InputError, match="q must be"):
        reference.prefill(torch.randn(4, 3, 64), k, k, cu, cu, layer)
    with pytest.raises(InputError, match="int32"):
        reference.prefill(q, k, k, cu.long(), cu, layer)
    with pytest.raises(InputError, match=r"cu_seqlens_k\[-1\]"):
        reference.prefill(q, k, k, cu, torch.tensor([0, 5], dtype=torch.int32), layer)
    with pytest.raises(InputError, match="dtype"):
        reference.prefill(q, k.half(), k, cu, cu, layer)
    with pytest.raises(InputError, match="LayerSpec"):
        reference.prefill(q, k, k, cu, cu, "phi3small")
    for bad in (0.0, -0.1, float("nan"), float("inf"), "x"):
        with pytest.raises(InputError, match="scale"):
            reference.prefill(q, k, k, cu, cu, layer, scale=bad)
    problem = DecodeProblem(layer, [5, 9], page_size=8, seed=1, dtype=torch.float32)
    args = list(problem.args())
    args[3] = args[3].clone()
    args[3][1, 1] = 10_000
    with pytest.raises(InputError, match=r"block_tables\[1, 1\]"):
        reference.paged_decode(*args)
    args = list(problem.args())
    args[4] = torch.tensor([5, 100], dtype=torch.int32)
    with pytest.raises(InputError, match=r"seq_lens\[1\]"):
        reference.paged_decode(*args)
    args = list(problem.args())
    args[4] = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(InputError, match=r"seq_lens\[0\]"):
        reference.paged_decode(*args)


def test_dispatch_without_gpu(monkeypatch):
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(dense=True),) * 2)
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    assert torch.equal(sg.prefill(q, k, k, cu, cu, layer), reference.prefill(q, k, k, cu, cu, layer))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(sg.ImplUnavailableError, match="TRITON_INTERPRET"):
        sg.prefill(q, k, k, cu, cu, layer, impl="triton")
    with pytest.raises(sg.ImplUnavailableError, match="CUDA"):
        problem = DecodeProblem(layer, [5], page_size=8, seed=1, dtype=torch.float32)
        sg.paged_decode(*problem.args(), impl="cuda")
    with pytest.raises(InputError, match="impl"):
        sg.prefill(q, k, k, cu, cu, layer, impl="cuda")


def test_interpreter_set_too_late_is_a_clear_error(monkeypatch):
    import triton  # noqa: F401 - imported without TRITON_INTERPRET, as in this test process

    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(dense=True),) * 2)
    q, k = torch.randn(4, 2, 64, dtype=torch.float16), torch.randn(4, 1, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if ops.interpreter_usable():
        pytest.skip("this process started with TRITON_INTERPRET=1, so the interpreter is active")
    with pytest.raises(sg.ImplUnavailableError, match="after Triton was imported"):
        sg.prefill(q, k, k, cu, cu, layer, impl="triton")


def test_decode_problem_as_prefill_gives_decode_as_its_last_row():
    """DecodeProblem.as_prefill (the GPU tiers' metamorphic check) on the oracle itself."""
    import sparsegen
    from sparsegen import reference
    from sparsegen.testing import DecodeProblem

    for layer in (
        sparsegen.get_pattern("phi3small").layers[0],
        sparsegen.get_pattern("sliding-window").layers[0],
    ):
        p = DecodeProblem(layer, [300, 77], 16, seed=2, dtype=torch.float32)
        want = reference.paged_decode(*p.args())  # [B, H, D]
        for b in (0, 1):
            q, k, v, cu, _ = p.as_prefill(b)
            assert q.shape == (p.seq_lens[b], layer.num_heads, layer.head_dim) and k.shape[0] == p.seq_lens[b]
            last = reference.prefill(q, k, v, cu, cu, layer, p.scale)[-1]
            torch.testing.assert_close(last, want[b], rtol=1e-5, atol=1e-5)
