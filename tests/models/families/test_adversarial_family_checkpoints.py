"""Family checkpoints an attacker wrote: a mixture of experts that routes each token to more
experts than it has is refused at load, naming the field (it used to load, then fail inside the
first step with torch's "selected index k out of range"); the tensors of every family are
checked for presence, shape and dtype before anything runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.adversarial import refused
from helpers.extras import require
from safetensors.torch import load_file, save_file

from sparsegen.errors import CheckpointError
from sparsegen.models.families import config_from_dict

require("transformers")

GPT_OSS = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=96,
               num_local_experts=4)  # fmt: skip


@pytest.mark.parametrize("per_tok", [5, 99, 4096, 0, -1])
def test_more_experts_per_token_than_experts_is_refused(per_tok):
    refused(
        CheckpointError, "num_experts_per_tok", config_from_dict, {**GPT_OSS, "num_experts_per_tok": per_tok}
    )


@pytest.mark.parametrize("per_tok", [1, 2, 4])
def test_experts_per_token_up_to_the_experts_are_read(per_tok):
    assert config_from_dict({**GPT_OSS, "num_experts_per_tok": per_tok}).experts_per_tok == per_tok


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from helpers.hf_models import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("families"))


def _copy(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder, edit) -> None:
    file = next(folder.glob("*.safetensors"))
    tensors = load_file(str(file))
    edit(tensors)
    file.unlink()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _load(folder):
    from sparsegen import LLM

    return LLM(model=str(folder), max_num_seqs=2, device="cpu")


@pytest.mark.slow  # the module's checkpoints take transformers ~10 s to write
def test_gpt_oss_checkpoint_with_too_many_experts_per_token(checkpoints, tmp_path):
    folder = _copy(checkpoints["gpt_oss"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**cfg, "num_experts_per_tok": cfg["num_local_experts"] + 1})
    )
    refused(CheckpointError, "num_experts_per_tok", _load, folder)


EDITS = {
    "missing": lambda t, n: t.pop(n),
    "misshapen": lambda t, n: t.__setitem__(n, torch.zeros(*[s + 1 for s in t[n].shape])),
    "int": lambda t, n: t.__setitem__(n, t[n].to(torch.int32)),
    "scalar": lambda t, n: t.__setitem__(n, torch.tensor(1.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_bad_tensor_is_refused_naming_it(checkpoints, tmp_path, family, edit):
    folder = _copy(checkpoints[family], tmp_path)
    names = sorted(load_file(str(next(folder.glob("*.safetensors")))))
    name = next(n for n in names if "layers.1." in n and n.endswith("weight"))
    _edit_tensors(folder, lambda t: EDITS[edit](t, name))
    refused(CheckpointError, "|".join((name.replace(".", r"\."), "missing", "shape", "dtype")), _load, folder)


DTYPES = {"bf17": "torch_dtype", "float128": "torch_dtype", "int8": "torch_dtype", "auto": "torch_dtype",
          "torch.bfloat16": "torch_dtype", 16: "torch_dtype"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("value", list(DTYPES), ids=str)
def test_a_checkpoint_whose_dtype_names_no_float_dtype_is_refused(checkpoints, tmp_path, family, value):
    """Through the whole load (config.json in a folder): named by field before any weight is read."""
    folder = _copy(checkpoints[family], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("dtype", None)  # transformers reads `dtype` first; the older field is then the one read
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": value}))
    refused(CheckpointError, DTYPES[value], _load, folder)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_checkpoint_that_declares_half_loads(checkpoints, tmp_path, family):
    folder = _copy(checkpoints[family], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "half"}))
    assert _load(folder).vocab_size == cfg["vocab_size"]
