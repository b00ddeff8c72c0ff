"""Bad checkpoints of a decoder family are refused with a CheckpointError naming the tensor or the
field, before anything runs; so is a tensor-parallel size that does not divide the KV heads."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.extras import require
from helpers.hf_families import write_family_checkpoint
from safetensors.torch import load_file, save_file

from sparsegen import LLM
from sparsegen.errors import CheckpointError, InputError
from sparsegen.models import load_checkpoint

require("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {
        f: write_family_checkpoint(tmp_path_factory.mktemp(f) / "ckpt", f)[0] for f in ("qwen3", "gpt_oss")
    }


def _copy(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "family,edit,message",
    [
        ("qwen3", lambda t: t.pop("model.layers.0.self_attn.q_norm.weight"), "lacks tensor 'model.layers.0.self_attn.q_norm"),
        ("qwen3", lambda t: t.update(extra=torch.ones(2)), "holds tensor 'extra', which the qwen3 model has no place"),
        ("gpt_oss", lambda t: t.update({"model.layers.1.self_attn.sinks": torch.ones(3)}), "sinks' .* has shape \\(3,\\)"),
        ("gpt_oss", lambda t: t["model.layers.0.mlp.experts.down_proj"].fill_(float("nan")), "not finite"),
        ("gpt_oss", lambda t: t.pop("lm_head.weight"), "tie_word_embeddings=false"),
    ],
)  # fmt: skip
def test_bad_tensors_are_named(folders, tmp_path, family, edit, message):
    folder = _copy(folders[family], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder, dtype=torch.float32)


def test_bad_family_field_is_named(folders, tmp_path):
    folder = _copy(folders["gpt_oss"], tmp_path / "bad", lambda t: None)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": "2"}))
    with pytest.raises(CheckpointError, match="'num_experts_per_tok' must be an int"):
        load_checkpoint(folder)


def test_tensor_parallel_size_that_splits_a_kv_group_is_refused(folders):
    with pytest.raises(InputError, match="does not divide the model's 2 KV heads .*num_key_value_heads"):
        LLM(model=folders["qwen3"], tensor_parallel_size=4, device="cpu")
