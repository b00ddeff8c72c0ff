"""Phi-3-Small's config.json fields, LongRoPE rules and the named random sizes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.checkpoint import TINY_HF_CONFIG

from sparsegen.models import CheckpointError, Phi3SmallConfig, model_spec, named_config
from sparsegen.models.config import default_mscale
from sparsegen.models.rope import Rotary

PHI3_SMALL_8K = {
    "model_type": "phi3small",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "ff_intermediate_size": 14336,
    "vocab_size": 100352,
    "blocksparse_block_size": 64,
    "blocksparse_num_local_blocks": 16,
    "blocksparse_vert_stride": 8,
    "blocksparse_homo_head_pattern": False,
    "dense_attention_every_n_layers": 2,
    "mup_attn_multiplier": 1.0,
    "mup_embedding_multiplier": 10.0,
    "mup_use_scaling": True,
    "mup_width_multiplier": 8.0,
    "rope_embedding_base": 1000000,
    "rope_position_scale": 1.0,
    "layer_norm_epsilon": 1e-05,
    "gegelu_limit": 20.0,
    "bos_token_id": 100257,
    "eos_token_id": 100257,
    "max_position_embeddings": 8192,
}


def _longrope(**extra):
    rs = {
        "type": "su",
        "short_factor": [1.0] * 64,
        "long_factor": [2.0] * 64,
        "original_max_position_embeddings": 8192,
    }
    rs.update(extra)
    return dict(PHI3_SMALL_8K, max_position_embeddings=131072, rope_scaling=rs)


def test_phi3small_fields_and_derived_values():
    cfg = Phi3SmallConfig.from_hf_dict(PHI3_SMALL_8K)
    assert cfg.head_dim == 128 and cfg.group_size == 4
    assert cfg.attention_scale == pytest.approx(1 / 128)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.dummy_token_indices is None
    spec = model_spec(cfg)
    assert [layer.is_dense for layer in spec.layers] == [(i + 1) % 2 == 0 for i in range(32)]
    assert [h.vert_offset for h in spec.layers[0].heads[:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert all(layer.is_dense for layer in model_spec(cfg, force_dense=True).layers)
    assert Phi3SmallConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_intermediate_size_fallback_pads_to_256():
    cfg = dict(PHI3_SMALL_8K, ff_intermediate_size=None, ff_dim_multiplier=3.3)
    assert Phi3SmallConfig.from_hf_dict(cfg).ff_intermediate_size == math.ceil(4096 * 3.3 / 256) * 256


def test_longrope_mscale_given_and_default():
    cfg = Phi3SmallConfig.from_hf_dict(_longrope(short_mscale=1.0, long_mscale=1.19))
    assert cfg.rope_scaling.long_mscale == 1.19 and cfg.rope_scaling.short_mscale == 1.0
    cfg = Phi3SmallConfig.from_hf_dict(_longrope())
    expected = math.sqrt(1 + math.log(16) / math.log(8192))
    assert cfg.rope_scaling.long_mscale == pytest.approx(expected)
    assert cfg.rope_scaling.short_mscale == pytest.approx(expected)
    assert default_mscale(8192, 8192) == 1.0
    assert Phi3SmallConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_longrope_picks_factors_and_ignores_position_scale():
    cfg = Phi3SmallConfig.from_hf_dict(
        dict(_longrope(short_mscale=1.0, long_mscale=1.5), rope_position_scale=3.0)
    )
    rot = Rotary(cfg)
    pos = torch.tensor([0, 5, 9000])
    cos_s, sin_s = rot.cos_sin(pos, torch.tensor([False, False, False]))
    cos_l, sin_l = rot.cos_sin(pos, torch.tensor([True, True, True]))
    inv = 1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    ang = pos[:, None].double() * inv[None]  # rope_position_scale is ignored with LongRoPE
    torch.testing.assert_close(cos_s[:, :64].double(), ang.cos(), atol=1e-3, rtol=0)  # float32 angles, as HF
    torch.testing.assert_close(sin_l[:, 64:].double(), 1.5 * (ang / 2).sin(), atol=1e-3, rtol=0)
    assert torch.equal(cos_l[0], torch.full((128,), 1.5))


def test_plain_rope_scales_positions():
    cfg = Phi3SmallConfig.from_hf_dict(dict(PHI3_SMALL_8K, rope_position_scale=0.5))
    cos, _ = Rotary(cfg).cos_sin(torch.tensor([4]), None)
    cos_ref, _ = Rotary(Phi3SmallConfig.from_hf_dict(PHI3_SMALL_8K)).cos_sin(torch.tensor([2]), None)
    torch.testing.assert_close(cos, cos_ref)


def test_neox_rotation_preserves_norm_and_rotates_halves():
    cfg = named_config("tiny")
    x = torch.randn(3, 2, 64)
    cos, sin = Rotary(cfg).cos_sin(torch.tensor([0, 1, 7]), None)
    y = Rotary.apply(x, cos, sin)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # pair (i, i + D/2) rotates by angle pos * base^(-2i/D)
    angle = 7 * 10000 ** (-2 * 3 / 64)
    a, b = x[2, 0, 3], x[2, 0, 35]
    torch.testing.assert_close(y[2, 0, 3], a * math.cos(angle) - b * math.sin(angle), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "not supported"),
        ("rope_scaling", {"type": "su", "short_factor": [1.0], "long_factor": [1.0] * 64}, "short_factor"),
        ("num_key_value_heads", 5, "divide evenly"),
        ("mup_use_scaling", "yes", "mup_use_scaling"),
        ("dummy_token_indices", "all", "dummy_token_indices"),
    ],
)
def test_bad_fields_are_named(field, value, match):
    with pytest.raises(CheckpointError, match=match):
        Phi3SmallConfig.from_hf_dict({**PHI3_SMALL_8K, field: value})


def test_named_sizes():
    tiny = named_config("tiny")
    assert Phi3SmallConfig.from_hf_dict(TINY_HF_CONFIG) == tiny
    assert tiny.head_dim in (64, 96, 128)
    big = named_config("7b")
    assert (big.hidden_size, big.num_hidden_layers, big.head_dim, big.vocab_size) == (4096, 32, 128, 100352)
    assert big.rope_scaling is not None and big.max_position_embeddings >= 32768 + 1024
    with pytest.raises(CheckpointError, match="unknown model size 'huge'"):
        named_config("huge")
