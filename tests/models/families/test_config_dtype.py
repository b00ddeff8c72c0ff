"""`dtype` / `torch_dtype` in a checkpoint config, for every family, against transformers: a name
`AutoConfig` cannot read is a CheckpointError naming the field; a floating dtype of 16 bits or
more that it reads loads here too, as the same torch dtype; one it reads but that says the
weights are quantized or not floats (int8, bool, complex64, float8) is refused naming the
field (sparsegen cannot honour it). `dtype` wins over `torch_dtype`, as in transformers."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers.extras import require

from sparsegen.errors import CheckpointError
from sparsegen.models.config import named_config
from sparsegen.models.config_dtype import config_dtype
from sparsegen.models.families import DECODERS, config_from_dict

transformers = require("transformers")

MINIMAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=32)
NAMES = ["bfloat16", "float16", "float32", "float64", "half", "float", "double", "int8", "bool",
         "complex64", "float8_e4m3fn", "float128", "bf17", "auto", "", "torch.float16", "BFloat16",
         "cuda", "__name__"]  # fmt: skip
CAN_RUN = {torch.bfloat16, torch.float16, torch.float32, torch.float64}


def decoder(model_type: str) -> dict:
    return {"model_type": model_type, **MINIMAL}


def theirs(tmp_path, cfg: dict):
    """transformers' reading of `cfg` as a config.json: its dtype, or the exception it raises."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return transformers.AutoConfig.from_pretrained(str(tmp_path)).dtype
        except Exception as exc:  # the oracle refuses: AttributeError for an unknown name
            return exc


@pytest.mark.parametrize("field", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_decoder_dtype_as_transformers_reads_it(tmp_path, model_type, name, field):
    cfg = {**decoder(model_type), field: name}
    want = theirs(tmp_path, cfg)
    if isinstance(want, torch.dtype) and want in CAN_RUN:
        config_from_dict(cfg)  # loads
        assert config_dtype(cfg, "config.json") == want
        return
    with pytest.raises(CheckpointError, match=f"'{field}'"):
        config_from_dict(cfg)
    if isinstance(want, torch.dtype):  # transformers reads it; it is not a float model sparsegen runs
        assert "quantized or non-float" in _message(cfg)


def _message(cfg: dict) -> str:
    try:
        config_from_dict(cfg)
    except CheckpointError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("name", NAMES)
def test_phi3small_dtype_as_pretrained_config_reads_it(name):
    """Phi-3-Small's config class is remote code built on PretrainedConfig, whose rule it keeps."""
    cfg = {**named_config("tiny").to_hf_dict(), "torch_dtype": name}
    try:
        want = transformers.PretrainedConfig(torch_dtype=name).dtype
    except Exception:
        want = None
    if isinstance(want, torch.dtype) and want in CAN_RUN:
        assert config_from_dict(cfg).vocab_size > 0
        return
    with pytest.raises(CheckpointError, match="'torch_dtype'"):
        config_from_dict(cfg)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_dtype_wins_over_torch_dtype_as_in_transformers(tmp_path, model_type):
    """A bad `torch_dtype` beside a good `dtype` is what transformers ignores, so it loads; a bad
    `dtype` beside a good `torch_dtype` is what transformers reads, so it is refused."""
    cfg = {**decoder(model_type), "torch_dtype": "bf17", "dtype": "float16"}
    assert theirs(tmp_path, cfg) == torch.float16
    config_from_dict(cfg)
    cfg = {**decoder(model_type), "torch_dtype": "float16", "dtype": "bf17"}
    assert isinstance(theirs(tmp_path, cfg), Exception)
    with pytest.raises(CheckpointError, match="'dtype'"):
        config_from_dict(cfg)
    cfg = {**decoder(model_type), "torch_dtype": "float16", "dtype": None}  # null: the older field
    assert theirs(tmp_path, cfg) == torch.float16 and config_dtype(cfg, "x") == torch.float16


@pytest.mark.parametrize("value", [16, True, ["float16"], 1.5, {"text": "bf17"}, {"text": "int8"}])
def test_a_dtype_that_is_no_name_is_refused(value):
    with pytest.raises(CheckpointError, match="dtype"):
        config_from_dict({**decoder("llama"), "torch_dtype": value})


def test_a_per_sub_model_map_of_float_dtypes_loads(tmp_path):
    cfg = {**decoder("llama"), "torch_dtype": {"text_config": "bfloat16", "vision": "float16"}}
    assert config_dtype(cfg, "x") == {"text_config": torch.bfloat16, "vision": torch.float16}
    config_from_dict(cfg)


def test_a_missing_or_null_dtype_loads():
    for cfg in (decoder("qwen2"), {**decoder("qwen2"), "torch_dtype": None, "dtype": None}):
        assert config_dtype(cfg, "x") is None
        config_from_dict(cfg)
