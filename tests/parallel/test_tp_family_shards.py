"""What each tensor-parallel rank of a decoder family holds, without processes (no collective runs
at build or load): every rank's tensors, read from a transformers checkpoint (its own rows of
q_proj / k_proj / v_proj / gate_proj / up_proj placed into the fused rows, its slices of o_proj,
down_proj, sinks and the experts) or drawn at random, are exactly its cut of the one-process
model's fused tensors; the ranks' cuts together cover each tensor; the specs keep the global heads
and the layer's soft-cap and sinks. A size that splits a KV group or the intermediate units is
refused before any rank starts, naming config.json's field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.extras import require
from helpers.hf_families import FAMILY_CASES, write_family_checkpoint

from sparsegen.engine import LLMEngine
from sparsegen.errors import InputError
from sparsegen.models import load_checkpoint, random_model
from sparsegen.models.families import config_from_dict, config_from_file
from sparsegen.parallel import decoder_sharding
from sparsegen.parallel.decoder_sharding import ShardedMixtureOfExperts, random_tp_decoder
from sparsegen.parallel.loader import load_tp_checkpoint
from sparsegen.parallel.sharding import TPShard
from sparsegen.parallel.source import ModelSource

require("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


class _Folders(dict):
    """family -> its tiny checkpoint folder, written on first use."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, family):
        self[family] = write_family_checkpoint(self.factory.mktemp(family) / "ckpt", family)[0]
        return self[family]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory)


def _check_cuts(whole, ranks, config):
    """Every tensor of each rank is its cut of the whole model's; the cuts tile the whole tensor."""
    full = dict(whole.named_parameters())
    for r, model in enumerate(ranks):
        names = dict(model.named_parameters())
        assert names.keys() == full.keys()
        for name, local in names.items():
            want = decoder_sharding.take_shard(name, full[name], config, model.shard, local)
            torch.testing.assert_close(local, want, rtol=0, atol=0, msg=f"rank {r}: {name}")
    for name, param in full.items():
        rng = decoder_sharding.shard_range(name, config, ranks[0].shard)
        if rng is None:
            continue
        dim, _, _ = rng
        spans = [decoder_sharding.shard_range(name, config, m.shard)[1:] for m in ranks]
        assert spans[0][0] == 0 and spans[-1][1] == param.shape[dim], name
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_loaded_ranks_hold_their_cut_of_the_fused_model(folders, family):
    folder = folders[family]
    whole = load_checkpoint(folder, dtype=torch.float32, device="cpu")
    ranks = [load_tp_checkpoint(folder, TPShard(r, 2), dtype=torch.float32, device="cpu") for r in range(2)]
    _check_cuts(whole, ranks, whole.config)
    for model in ranks:
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, model.local_num_kv_heads) == (2, 1, 1)
        for mine, glob in zip(model.spec.layers, whole.spec.layers, strict=True):
            k0 = model.shard.rank
            assert mine.heads == glob.heads[k0 * 2 : k0 * 2 + 2]  # global heads (vertical offsets)
            assert (mine.logit_softcap, mine.learned_sinks) == (glob.logit_softcap, glob.learned_sinks)
        if family == "gpt_oss":
            moe = model.model.layers[0].mlp
            assert isinstance(moe, ShardedMixtureOfExperts)
            assert tuple(moe.experts.down_proj.shape) == (4, 48, 64)  # every expert, F / 2
            assert moe.experts.down_bias_on == (model.shard.rank == 0)  # the bias added once


@pytest.mark.parametrize("family, edit", [("gemma2", {}), ("gpt_oss", {}), ("qwen2", {"vocab_size": 95})])
def test_random_ranks_are_cuts_of_random_model(folders, family, edit):
    """(A vocabulary of 95: the second rank's lm_head rows end in one row of zero padding.)"""
    config = config_from_dict({**json.loads((folders[family] / "config.json").read_text()), **edit})
    whole = random_model(config, seed=5, dtype=torch.float32, device="cpu")
    ranks = [
        random_tp_decoder(config, TPShard(r, 2), seed=5, dtype=torch.float32, device="cpu") for r in range(2)
    ]
    _check_cuts(whole, ranks, config)
    if edit:
        assert ranks[1].lm_head.weight.shape[0] == 48 and not ranks[1].lm_head.weight[47].any()


def test_tied_embeddings_give_each_rank_its_vocabulary_rows(folders, tmp_path):
    folder = shutil.copytree(folders["qwen3"], tmp_path / "tied")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"]
    for r in range(2):
        model = load_tp_checkpoint(folder, TPShard(r, 2), dtype=torch.float32, device="cpu")
        torch.testing.assert_close(model.lm_head.weight, emb[r * 48 : (r + 1) * 48], rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit, tp, message",
    [
        ({}, 4, "does not divide the model's 2 KV heads .*num_key_value_heads"),
        ({}, 3, "does not divide the model's 2 KV heads"),
        ({"intermediate_size": 90}, 4, "does not divide the model's 2 KV heads"),
        ({"num_key_value_heads": 4, "intermediate_size": 95}, 2, "does not divide intermediate_size 95"),
        ({}, 0, "tensor_parallel_size must be >= 1"),
        ({}, True, "tensor_parallel_size must be an int"),
    ],
)
def test_sizes_the_shards_cannot_take_are_refused_before_any_rank(folders, tmp_path, edit, tp, message):
    folder = tmp_path / "edited"
    folder.mkdir()
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    (folder / "model.safetensors").write_bytes(b"never read")  # refused before any weight is read
    with pytest.raises(InputError, match=message):
        LLMEngine(ModelSource(model_dir=str(folder)), tensor_parallel_size=tp, device="cpu")


def test_a_rank_built_directly_refuses_an_indivisible_split(folders):
    config = config_from_file(folders["mistral"] / "config.json")
    with pytest.raises(InputError, match="does not divide the model's 2 KV heads"):
        random_tp_decoder(config, TPShard(0, 4), dtype=torch.float32, device="cpu")
