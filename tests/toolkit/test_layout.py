"""Masks and counts against DESIGN §1's numbers and an independent, loop-based implementation."""

from __future__ import annotations

import pytest
import torch
from helpers.specs import sees
from hypothesis import given
from hypothesis import strategies as st

import sparsegen as sg
from sparsegen.layout import block_mask, decode_pages, head_key_counts, visible_counts
from sparsegen.testing import head_specs, layer_specs

PHI3 = sg.get_pattern("phi3small").layers[0]


def test_phi3small_density_at_8192():
    dens = sg.density(PHI3, 8192)
    expected = [0.3182, 0.3199, 0.3216, 0.3233, 0.3250, 0.3267, 0.3285, 0.3302]
    assert dens[:8].tolist() == pytest.approx(expected, abs=1e-4)
    assert dens[8:16].tolist() == pytest.approx(expected, abs=1e-4)  # h and h+8 share a pattern
    assert float(dens.mean()) == pytest.approx(0.3242, abs=1e-4)


@pytest.mark.slow
def test_phi3small_density_falls_toward_one_eighth():
    blocks_32k = block_mask(PHI3, 32768, 64).float()
    n = 512
    assert float(blocks_32k.sum() / (32 * n * (n + 1) / 2)) == pytest.approx(0.179, abs=1e-3)
    assert float(sg.density(PHI3, 131072).mean()) < float(sg.density(PHI3, 32768).mean()) < 0.3242


def test_phi3small_decode_counts():
    at_1024 = visible_counts(PHI3, torch.tensor([1024]))[:, 0].tolist()
    assert at_1024 == [1025 if h % 8 == 7 else 961 for h in range(32)]
    assert visible_counts(PHI3, torch.tensor([8191]))[:, 0].tolist() == [1920] * 32


def test_phi3small_equals_dense_up_to_1024_tokens():
    assert bool(sg.visible_mask(PHI3, 1024).all(dim=0).equal(torch.ones(1024, 1024).tril().bool()))
    assert not sg.visible_mask(PHI3, 1025)[0].equal(torch.ones(1025, 1025).tril().bool())


def test_heads_7_15_23_31_see_block_zero():
    mask = sg.visible_mask(PHI3, 1, 8192)[:, 0, :64].all(dim=1)
    assert mask.nonzero().flatten().tolist() == [7, 15, 23, 31]


def test_gqa_union_of_blocks():
    pages = decode_pages(PHI3, 32768, 64).float().mean(dim=1)
    per_head = sg.visible_mask(PHI3, 1, 32768)[:, 0].view(32, 512, 64).any(-1).float().mean(-1)
    assert 0.13 <= float(per_head.min()) and float(per_head.max()) <= 0.33
    assert all(0.13 < float(p) < 0.63 for p in pages)
    assert float(pages.min()) > float(per_head.max())


@given(head_specs(), st.integers(1, 200), st.data())
def test_mask_matches_independent_implementation(head, n_k, data):
    n_q = data.draw(st.integers(0, n_k))
    layer = sg.LayerSpec(num_heads=1, num_kv_heads=1, head_dim=64, heads=(head,))
    mask = sg.visible_mask(layer, n_q, n_k)[0]
    first = n_k - n_q
    expected = torch.tensor(
        [[sees(head, first + r, j) for j in range(n_k)] for r in range(n_q)], dtype=torch.bool
    ).reshape(n_q, n_k)
    assert torch.equal(mask, expected)


@given(head_specs(), st.integers(1, 1500))
def test_closed_form_counts_match_mask(head, seq_len):
    layer = sg.LayerSpec(num_heads=1, num_kv_heads=1, head_dim=64, heads=(head,))
    mask = sg.visible_mask(layer, seq_len)[0]
    assert torch.equal(head_key_counts(head, torch.arange(seq_len)), mask.sum(dim=1))


@given(layer_specs(max_kv_heads=2), st.integers(1, 400), st.sampled_from([8, 16, 64, 128]))
@pytest.mark.slow
def test_block_and_page_maps_match_mask(layer, seq_len, size):
    mask = sg.visible_mask(layer, seq_len)
    blocks = block_mask(layer, seq_len, size)
    nb = blocks.shape[1]
    padded = torch.nn.functional.pad(mask, (0, nb * size - seq_len, 0, nb * size - seq_len))
    assert torch.equal(blocks, padded.view(layer.num_heads, nb, size, nb, size).any(4).any(2))
    pages = decode_pages(layer, seq_len, size)
    last = torch.nn.functional.pad(mask[:, -1], (0, nb * size - seq_len)).view(layer.num_heads, nb, size)
    union = last.any(2).view(layer.num_kv_heads, layer.group_size, nb).any(1)
    assert torch.equal(pages, union)


def test_density_is_memory_bounded_at_128k():
    # O(S) closed form: 128K tokens x 32 heads must not build an [H, S, S] tensor (that is 512 GiB).
    dens = sg.density(PHI3, 131072)
    assert dens.shape == (32,) and 0.12 < float(dens.mean()) < 0.16


def test_visible_mask_argument_errors():
    with pytest.raises(ValueError, match="n_q <= n_k"):
        sg.visible_mask(PHI3, 10, 5)
    with pytest.raises(ValueError, match="seq_len"):
        sg.density(PHI3, 0)
