"""sparsegen.flex with the attention features: sink tokens in the mask, soft-cap as a score_mod,
learned sinks through the LSE rescale (FlexAttention has no sink argument)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

import sparsegen as sg
from sparsegen import flex
from sparsegen.errors import InputError

LAYER = sg.LayerSpec(
    4, 2, 32,
    (
        sg.HeadSpec(block_size=16, sliding_window=9, sink_tokens=4),
        sg.HeadSpec(block_size=16, local_blocks=1, vert_stride=3, vert_offset=1, sink_tokens=20),
        sg.HeadSpec(block_size=16, dense=True),
        sg.HeadSpec(block_size=16, sliding_window=5),
    ),
    logit_softcap=3.0,
    learned_sinks=True,
)  # fmt: skip


@pytest.mark.parametrize("n_q,n_k", [(70, 70), (13, 90)])
def test_mask_mod_sees_the_sink_tokens(n_q, n_k):
    got = create_mask(flex.mask_mod(LAYER, n_q, n_k), 1, 4, n_q, n_k, device="cpu")[0]
    assert torch.equal(got, sg.visible_mask(LAYER, n_q, n_k))
    assert got[0, -1, :4].all() and not got[3, -1, :4].any()


def test_score_mod_is_none_without_softcap():
    assert flex.score_mod(sg.LayerSpec(1, 1, 64, (sg.HeadSpec(dense=True),))) is None
    with pytest.raises(InputError, match="LayerSpec"):
        flex.score_mod("layer")


def test_flex_with_softcap_and_sinks_equals_reference():
    n_q, n_k = 40, 90
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n_q, 32, generator=gen)
    k, v = torch.randn(2, 1, 2, n_k, 32, generator=gen)
    sinks = torch.randn(4, generator=gen)
    cu_q, cu_k = torch.tensor([0, n_q], dtype=torch.int32), torch.tensor([0, n_k], dtype=torch.int32)

    def sg_layout(x):  # [1, H, n, D] -> [n, H, D]
        return x[0].transpose(0, 1).contiguous()

    ref = sg.reference.prefill(sg_layout(q), sg_layout(k), sg_layout(v), cu_q, cu_k, LAYER, 0.3, sinks=sinks)
    with warnings.catch_warnings():  # the unfused CPU path, on purpose
        warnings.simplefilter("ignore", UserWarning)
        out, lse = flex_attention(q, k, v, score_mod=flex.score_mod(LAYER), block_mask=flex.block_mask(LAYER, n_q, n_k),
                                  scale=0.3, enable_gqa=True, return_lse=True)  # fmt: skip
    got = sg_layout(flex.apply_learned_sinks(out, lse, sinks))
    assert sg.testing.rel_err(got, ref) < 1e-5
    assert (
        sg.testing.rel_err(sg_layout(out), ref) > 1e-3
    )  # without the rescale it differs: the check can fail


def test_apply_learned_sinks_refuses_bad_shapes():
    with pytest.raises(InputError, match="sinks"):
        flex.apply_learned_sinks(torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3), torch.zeros(3))
