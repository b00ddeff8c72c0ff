"""Loading a tiny Phi-3-Small checkpoint written in the real HF format, and its error messages."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoint import (
    TINY_HF_CONFIG,
    random_tensors,
    write_checkpoint,
)
from safetensors.torch import save_file

from sparsegen.models import CheckpointError, checkpoint_weight_map, load_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


def test_loads_every_tensor_under_its_real_name(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG, seed=3)
    folder = write_checkpoint(tmp_path / "ckpt", tensors=tensors)
    model = load_checkpoint(folder, dtype=torch.float32)
    state = model.state_dict()
    for name, t in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            assert name not in state
            continue
        assert torch.equal(state[name], t), name
    # no lm_head in the checkpoint: tied to the embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.spec.layers[0].is_dense is False and model.spec.layers[1].is_dense


def test_sharded_with_index_untied_and_dtype_conversion(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG, seed=4, with_lm_head=True)
    folder = write_checkpoint(tmp_path / "ckpt", tensors=tensors, shards=3)
    assert (folder / "model.safetensors.index.json").exists()
    assert len(set(checkpoint_weight_map(folder).values())) == 3
    model = load_checkpoint(folder, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].bfloat16())
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_sharded_without_index(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", seed=5, shards=2)
    (folder / "model.safetensors.index.json").unlink()
    model = load_checkpoint(folder, dtype=torch.float32)
    assert model.config.hidden_size == 256


def _expect(match: str, folder, **kw):
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(folder, dtype=torch.float32, **kw)


def test_missing_folder_and_config(tmp_path):
    _expect("does not exist", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    _expect(r"config\.json", tmp_path / "empty")


def test_malformed_config(tmp_path):
    folder = write_checkpoint(tmp_path / "a")
    (folder / "config.json").write_text("{not json")
    _expect(r"cannot read .*config\.json", folder)
    cfg = dict(TINY_HF_CONFIG, hidden_size="big")
    folder = write_checkpoint(tmp_path / "b", cfg=cfg, tensors={})
    _expect(r"config\.json: field 'hidden_size' must be an int, got 'big'", folder)


def test_missing_tensor_names_it(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG)
    del tensors["model.layers.2.mlp.down_proj.bias"]
    _expect(
        r"lacks tensor 'model\.layers\.2\.mlp\.down_proj\.bias'",
        write_checkpoint(tmp_path / "c", tensors=tensors),
    )


def test_wrong_shape_names_file_and_tensor(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG)
    tensors["model.layers.0.self_attn.dense.weight"] = torch.randn(256, 128)
    folder = write_checkpoint(tmp_path / "d", tensors=tensors)
    _expect(
        r"tensor 'model\.layers\.0\.self_attn\.dense\.weight' in .*model\.safetensors has shape \(256, 128\)",
        folder,
    )


def test_unexpected_tensor(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.randn(4, 4)
    _expect(r"q_proj\.weight.*no place", write_checkpoint(tmp_path / "e", tensors=tensors))


def test_non_finite_tensor(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG)
    tensors["model.final_layernorm.bias"][3] = float("nan")
    _expect(r"'model\.final_layernorm\.bias'.*not finite", write_checkpoint(tmp_path / "n", tensors=tensors))


def test_corrupt_safetensors_file(tmp_path):
    folder = write_checkpoint(tmp_path / "f")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    _expect(r"cannot read .*model\.safetensors", folder)


def test_no_safetensors(tmp_path):
    folder = write_checkpoint(tmp_path / "g")
    (folder / "model.safetensors").unlink()
    _expect(r"no \*\.safetensors", folder)


def test_index_errors(tmp_path):
    folder = write_checkpoint(tmp_path / "h", shards=2)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.final_layernorm.bias"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    _expect(r"maps tensor 'model\.final_layernorm\.bias' to 'model-00009.*does not exist", folder)

    folder = write_checkpoint(tmp_path / "i", shards=2)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.mlp.up_proj.bias"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    _expect(rf"{other}.* lacks tensor '{name}'", folder)


def test_untied_config_needs_lm_head(tmp_path):
    folder = write_checkpoint(tmp_path / "j", cfg=dict(TINY_HF_CONFIG, tie_word_embeddings=False))
    _expect(r"lm_head\.weight.*tie_word_embeddings=false", folder)


def test_duplicate_tensor_across_shards(tmp_path):
    folder = write_checkpoint(tmp_path / "k")
    save_file({"model.final_layernorm.bias": torch.randn(256)}, str(folder / "extra.safetensors"))
    _expect(r"'model\.final_layernorm\.bias' appears in both", folder)
