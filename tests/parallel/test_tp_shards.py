"""Tensor-parallel shards in one process: specs keep global head numbers, weights are exact
slices of the whole model's, and the sharded pieces recombine to the whole computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoint import write_checkpoint

from sparsegen import reference
from sparsegen.models import load_checkpoint, named_config, random_model
from sparsegen.models.phi3small import gegelu, model_spec
from sparsegen.parallel.loader import load_tp_checkpoint
from sparsegen.parallel.sharding import (
    TPShard,
    random_tp_model,
    shard_layer_spec,
    shard_range,
    take_shard,
)
from sparsegen.presets import blocksparse_heads, get_pattern
from sparsegen.spec import LayerSpec

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_phi3small_rank_specs_keep_global_offsets(tp):
    layer = get_pattern("phi3small").layers[0]  # sparse: offset of global head h is h % 8
    heads = []
    for r in range(tp):
        local = shard_layer_spec(layer, TPShard(r, tp))
        assert (local.num_heads, local.num_kv_heads, local.head_dim) == (32 // tp, 8 // tp, 128)
        assert local.heads == layer.heads[r * 32 // tp : (r + 1) * 32 // tp]
        heads += local.heads
    assert tuple(heads) == layer.heads
    if tp == 8:  # rank 1 holds global heads 4..7 (KV group 1): offsets 4..7, not a local 0..3
        assert [h.vert_offset for h in shard_layer_spec(layer, TPShard(1, 8)).heads] == [4, 5, 6, 7]


def test_rank_attention_equals_its_heads_of_the_whole_layer():
    spec = model_spec(named_config("tiny"))
    layer = spec.layers[0]  # 4 heads, offsets 0..3, block 16, 2 local blocks, stride 4
    assert not layer.is_dense
    t, gen = 100, torch.Generator().manual_seed(0)
    q = torch.randn(t, 4, 64, generator=gen)  # [T, H, D]
    k, v = torch.randn(t, 2, 64, generator=gen), torch.randn(t, 2, 64, generator=gen)  # [T, Hkv, D]
    cu = torch.tensor([0, t], dtype=torch.int32)
    whole = reference.prefill(q, k, v, cu, cu, layer)
    for r in range(2):
        local = shard_layer_spec(layer, TPShard(r, 2))
        sl = slice(2 * r, 2 * r + 2)
        out = reference.prefill(q[:, sl], k[:, r : r + 1], v[:, r : r + 1], cu, cu, local)
        torch.testing.assert_close(out, whole[:, sl], rtol=0, atol=0)
    # Numbering rank 1's heads locally (offsets 0, 1) would attend to other blocks: the check bites.
    renumbered = LayerSpec(
        2, 1, 64, blocksparse_heads(2, block_size=16, local_blocks=2, vert_stride=4, total_heads=4)
    )
    wrong = reference.prefill(q[:, 2:4], k[:, 1:2], v[:, 1:2], cu, cu, renumbered)
    assert not torch.allclose(wrong, whole[:, 2:4], atol=1e-3)


def _expected_shard(name, whole, config, shard):
    rng = shard_range(name, config, shard)
    if rng is None:
        return whole
    dim, a, b = rng
    return whole.narrow(dim, a, b - a)


@pytest.mark.parametrize("with_lm_head", [False, True])
def test_checkpoint_shards_are_slices_of_the_whole_checkpoint(tmp_path, with_lm_head):
    folder = write_checkpoint(tmp_path / "ckpt", shards=3, with_lm_head=with_lm_head, seed=2)
    whole = load_checkpoint(folder, dtype=torch.float32)
    tensors = dict(whole.named_parameters())
    tensors["lm_head.weight"] = whole.lm_head.weight  # tied: the same Parameter as the embedding
    for r in range(2):
        shard = TPShard(r, 2)
        part = load_tp_checkpoint(folder, shard, dtype=torch.float32)
        for name, p in part.named_parameters():
            assert torch.equal(p, _expected_shard(name, tensors[name], whole.config, shard)), name
        emb = part.model.embed_tokens.weight
        tied = part.lm_head.weight.data_ptr() == emb[r * 136 :].data_ptr()
        assert tied == (not with_lm_head)


def test_random_shards_are_slices_of_random_model():
    config = named_config("tiny")
    whole = random_model(config, seed=4)
    tensors = dict(whole.named_parameters())
    for r in range(2):
        shard = TPShard(r, 2)
        part = random_tp_model(config, shard, seed=4)
        assert [n for n, _ in part.named_parameters()] == list(tensors)  # the same draw order
        for name, p in part.named_parameters():
            assert torch.equal(p, _expected_shard(name, tensors[name], config, shard)), name


def test_interleaved_geglu_shards_sum_to_the_whole_mlp():
    config = named_config("tiny")
    mlp = random_model(config, seed=1).model.layers[0].mlp
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    want = mlp(x)
    w_up, b_up, w_down = mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight
    total = mlp.down_proj.bias.clone()
    for r in range(4):
        shard = TPShard(r, 4)
        up = F.linear(x, *(take_shard(f"model.layers.0.mlp.up_proj.{n}", t, config, shard, None)
                           for n, t in (("weight", w_up), ("bias", b_up))))  # fmt: skip
        down = take_shard("model.layers.0.mlp.down_proj.weight", w_down, config, shard, None)
        total = total + F.linear(gegelu(up, config.gegelu_limit), down)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    # Cutting up_proj as if it were [gate | linear] halves (each rank a block of each) breaks it.
    f, fl = config.ff_intermediate_size, config.ff_intermediate_size // 4
    wrong = mlp.down_proj.bias.clone()
    for r in range(4):
        rows = torch.cat([torch.arange(r * fl, (r + 1) * fl), f + torch.arange(r * fl, (r + 1) * fl)])
        up = F.linear(x, w_up[rows], b_up[rows])
        wrong = wrong + F.linear(gegelu(up, config.gegelu_limit), w_down[:, r * fl : (r + 1) * fl])
    assert not torch.allclose(wrong, want, atol=1e-3)


def test_vocab_shards_pad_the_last_rank_with_zeros():
    config = named_config("tiny")  # 272 rows; pretend 270 through the shard maths
    import dataclasses

    config = dataclasses.replace(config, vocab_size=270, dummy_token_indices=tuple(range(261, 270)))
    whole = torch.randn(270, 8)
    rows = [take_shard("lm_head.weight", whole, config, TPShard(r, 4), torch.empty(68, 8)) for r in range(4)]
    assert [tuple(x.shape) for x in rows] == [(68, 8)] * 4
    assert torch.equal(torch.cat(rows)[:270], whole)
    assert torch.equal(rows[3][66:], torch.zeros(2, 8))
