"""sparsegen.flex: FlexAttention's view of a spec equals sparsegen's, mask, blocks and output.

FlexAttention runs on a CPU in torch 2.13 (unfused, without torch.compile), so the output check
is in the CPU tier too: small shapes, float32, against sparsegen.reference.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from torch.nn.attention.flex_attention import create_mask, flex_attention

import sparsegen as sg
from sparsegen import flex
from sparsegen.testing import layer_specs, rel_err

HYBRID = sg.LayerSpec(
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    heads=(
        sg.HeadSpec(block_size=16, local_blocks=2, vert_stride=3, vert_offset=1),
        sg.HeadSpec(block_size=16, sliding_window=20),
        sg.HeadSpec(block_size=16, dense=True),
        sg.HeadSpec(block_size=16, local_blocks=1, vert_stride=2, vert_offset=0, sliding_window=7),
    ),
)


def _tokens_equal(layer, n_q, n_k):
    got = create_mask(flex.mask_mod(layer, n_q, n_k), 1, layer.num_heads, n_q, n_k, device="cpu")[0]
    assert torch.equal(got, sg.visible_mask(layer, n_q, n_k))


@settings(max_examples=8)
@given(layer_specs(hybrid=True))
@pytest.mark.slow
def test_mask_mod_equals_visible_mask_on_random_layers(layer):
    _tokens_equal(layer, 150, 200)


def test_mask_mod_equals_visible_mask_phi3small():
    # 1200 > 16 local blocks of 64: the vertical stride and the per-head offsets show
    _tokens_equal(sg.get_pattern("phi3small").layers[0], 1200, 1300)


def _pooled(mask: torch.Tensor, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any visible, all visible) per (query block, key block) of an [H, n_q, n_k] mask; the
    padding of a ragged last block counts as not visible, as in FlexAttention."""
    h, n_q, n_k = mask.shape
    pad = torch.zeros(h, -(-n_q // bq) * bq, -(-n_k // bk) * bk, dtype=torch.bool)
    pad[:, :n_q, :n_k] = mask
    tiles = pad.view(h, pad.shape[1] // bq, bq, pad.shape[2] // bk, bk)
    return tiles.any(4).any(2), tiles.all(4).all(2)


@pytest.mark.parametrize(("n_q", "n_k", "tile"), [(96, 96, 16), (70, 150, 16), (200, 333, 32), (1, 77, 16)])
def test_block_mask_blocks_equal_visible_mask_blocks(n_q, n_k, tile):
    bm = flex.block_mask(HYBRID, n_q, n_k, block_size=tile)
    any_seen, all_seen = _pooled(sg.visible_mask(HYBRID, n_q, n_k), tile, tile)
    dense = bm.to_dense()[0].bool()  # [H, q blocks, kv blocks]: every block FlexAttention visits
    assert torch.equal(dense, any_seen)
    full = torch.zeros_like(dense)  # blocks FlexAttention treats as fully visible (no mask_mod)
    for h in range(HYBRID.num_heads):
        for qb in range(dense.shape[1]):
            n = int(bm.full_kv_num_blocks[0, h, qb])
            full[h, qb, bm.full_kv_indices[0, h, qb, :n].long()] = True
    assert torch.equal(full, all_seen)


def _sg_layout(t: torch.Tensor) -> torch.Tensor:
    return t[0].transpose(0, 1).contiguous()  # [1, H, T, D] -> [T, H, D]


@pytest.mark.parametrize(
    "layer", [HYBRID, sg.get_pattern("phi3small").layers[0]], ids=["hybrid", "phi3small"]
)
@pytest.mark.slow
def test_flex_attention_output_equals_reference(layer):
    n_q, n_k = (70, 150) if layer is HYBRID else (16, 1600)  # past 16 local blocks: offsets matter
    gen = torch.Generator().manual_seed(0)
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.randn(1, h, n_q, d, generator=gen)
    k, v = torch.randn(2, 1, hkv, n_k, d, generator=gen)
    cu_q = torch.tensor([0, n_q], dtype=torch.int32)
    cu_k = torch.tensor([0, n_k], dtype=torch.int32)
    ref = sg.reference.prefill(_sg_layout(q), _sg_layout(k), _sg_layout(v), cu_q, cu_k, layer, scale=0.1)
    with warnings.catch_warnings():  # "called without torch.compile": the unfused CPU path, on purpose
        warnings.simplefilter("ignore", UserWarning)
        out = flex_attention(q, k, v, block_mask=flex.block_mask(layer, n_q, n_k), scale=0.1, enable_gqa=True)
        assert rel_err(_sg_layout(out), ref) < 1e-5
        # the check can fail: the mask of a neighbouring offset gives another answer
        shifted = sg.LayerSpec(
            num_heads=h,
            num_kv_heads=hkv,
            head_dim=d,
            heads=(layer.heads[1],) + layer.heads[:1] + layer.heads[2:],
        )
        other = flex_attention(
            q, k, v, block_mask=flex.block_mask(shifted, n_q, n_k), scale=0.1, enable_gqa=True
        )
        assert rel_err(_sg_layout(other), ref) > 1e-2


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (("not a layer", 4, 4), {}, "LayerSpec"),
        ((HYBRID, 0, 4), {}, "n_q"),
        ((HYBRID, 5, 4), {}, "n_q must be <= n_k"),
        ((HYBRID, 4.0, 4), {}, "n_q"),
        ((HYBRID, True, 4), {}, "n_q"),
        ((HYBRID, 4, "8"), {}, "n_k"),
        ((HYBRID, 4, 8), {"block_size": 24}, "block_size"),
        ((HYBRID, 4, 8), {"block_size": (16,)}, "block_size"),
        ((HYBRID, 4, 8), {"block_size": 0}, "block_size"),
    ],
)
def test_bad_arguments_are_input_errors(args, kwargs, needle):
    with pytest.raises(sg.InputError, match=needle):
        flex.block_mask(*args, **kwargs)
    if not kwargs:
        with pytest.raises(sg.InputError, match=needle):
            flex.mask_mod(*args)
