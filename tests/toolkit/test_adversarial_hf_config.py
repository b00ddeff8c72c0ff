"""HF configs read the way transformers reads them: for every model_type sparsegen maps, each
layer's window agrees with what transformers' own config class makes of the same file, with its
defaults (Mistral's 4096, gpt-oss's alternation, Gemma-3's pattern of 6, ...). A file that
transformers reads in a way sparsegen cannot honour, or reads differently from what it says, is
refused naming the field."""

from __future__ import annotations

import json

import pytest
from helpers import extras

import sparsegen as sg
from sparsegen.errors import CheckpointError, SpecError
from sparsegen.hf_config import model_spec_from_hf

SHAPE = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}
N = 12
ALT = ["sliding_attention", "full_attention"] * (N // 2)
ODD = ["full_attention", "sliding_attention", "sliding_attention"] * (N // 3)
CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "ministral": "MinistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig",
    "cohere2": "Cohere2Config",
    "gpt_oss": "GptOssConfig",
}
# Files as the hub holds them (older ones have no layer_types): (model_type, extra fields)
FILES = [
    ("llama", {}),
    ("llama", {"sliding_window": 100}),  # LlamaModel has no window: the field is ignored
    ("mistral", {}),  # no sliding_window key: transformers' default 4096
    ("mistral", {"sliding_window": None}),  # Mistral v0.2+
    ("mistral", {"sliding_window": 1000}),
    ("mistral", {"layer_types": ["sliding_attention"] * N, "sliding_window": 300}),
    ("ministral", {}),
    ("ministral", {"layer_types": ALT, "sliding_window": 500}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True}),  # window 4096 from layer 28 on: none of 12
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 4}),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 4, "sliding_window": None}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 512, "max_window_layers": 2}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 256, "layer_types": ODD}),
    ("qwen3", {"use_sliding_window": False, "sliding_window": 256, "layer_types": ODD}),
    ("gemma2", {}),  # alternates, window 4096
    ("gemma2", {"sliding_window": 512}),
    ("gemma2", {"layer_types": ODD, "sliding_window": 64}),
    ("gemma3_text", {}),  # no pattern field: transformers' default 6
    ("gemma3_text", {"sliding_window_pattern": 3}),
    ("gemma3_text", {"sliding_window_pattern": 6, "_sliding_window_pattern": 6}),
    ("gemma3_text", {"_sliding_window_pattern": 6}),
    ("gemma3_text", {"layer_types": ODD, "sliding_window": 1024, "use_bidirectional_attention": False}),
    ("cohere2", {}),  # pattern 4
    ("cohere2", {"sliding_window_pattern": 3, "sliding_window": 2048}),
    ("gpt_oss", {}),  # no layer_types: alternates, window 128
    ("gpt_oss", {"sliding_window": 64}),
    ("gpt_oss", {"layer_types": ODD}),
]


def _file(model_type: str, extra: dict) -> dict:
    return {"model_type": model_type, "num_hidden_layers": N, **SHAPE, **extra}


def _ours(cfg: dict) -> list[int | None]:
    spec = model_spec_from_hf(cfg, source="config.json")
    return [None if ly.is_dense else ly.heads[0].sliding_window for ly in spec.layers]


def _transformers(model_type: str, cfg: dict) -> list[int | None]:
    """Each layer's window as transformers' model for `model_type` would apply it."""
    transformers = extras.require("transformers")
    config = getattr(transformers, CLASSES[model_type]).from_dict(dict(cfg))
    assert config.num_hidden_layers == N
    if model_type == "llama":
        return [None] * N
    window = config.sliding_window
    if model_type == "mistral":  # MistralModel: one window (or none) for every layer
        return [window] * N
    return [window if t == "sliding_attention" else None for t in config.layer_types]


@pytest.mark.parametrize("model_type,extra", FILES, ids=[f"{t}-{sorted(e)}" for t, e in FILES])
def test_a_hub_file_maps_as_transformers_reads_it(model_type, extra):
    cfg = _file(model_type, extra)
    assert _ours(cfg) == _transformers(model_type, cfg)


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_transformers_own_default_config_written_out_maps_as_it_reads(model_type):
    """`Config(...)` -> `to_dict()` (a file as transformers saves it) -> the same windows."""
    transformers = extras.require("transformers")
    config = getattr(transformers, CLASSES[model_type])(num_hidden_layers=N, **SHAPE)
    written = json.loads(json.dumps(config.to_dict()))
    assert _ours(written) == _transformers(model_type, written)


def test_the_defaults_are_those_of_the_issue():
    """The values, written out, so that the mapping is pinned without transformers too."""
    assert _ours(_file("mistral", {})) == [4096] * N
    assert _ours(_file("gpt_oss", {})) == [128, None] * (N // 2)
    assert _ours(_file("gemma3_text", {})) == [4096] * 5 + [None] + [4096] * 5 + [None]
    assert _ours(_file("gemma3_text", {"_sliding_window_pattern": 6})) == _ours(_file("gemma3_text", {}))
    assert _ours(_file("cohere2", {})) == ([4096] * 3 + [None]) * 3
    assert (
        _ours(_file("qwen2", {"use_sliding_window": True, "max_window_layers": 10}))
        == [None] * 10 + [4096] * 2
    )
    assert _ours(_file("llama", {"sliding_window": 100})) == [None] * N


# -- what cannot be honoured is refused, naming the field -------------------------------------------
REFUSED = [
    # transformers ignores these fields when layer_types is absent and reads another pattern
    ("gemma3_text", {"_sliding_window_pattern": 3}, "_sliding_window_pattern"),
    ("cohere2", {"_sliding_window_pattern": 2}, "_sliding_window_pattern"),
    ("gemma2", {"sliding_window_pattern": 3}, "sliding_window_pattern"),
    ("gpt_oss", {"sliding_window_pattern": 4}, "sliding_window_pattern"),
    # MistralModel windows every layer, AutoConfig reads such a file as Ministral, per layer
    ("mistral", {"layer_types": ALT}, "layer_types"),
    ("mistral", {"use_sliding_window": False}, "use_sliding_window"),
    # bidirectional attention: no sparsegen spec is
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"use_bidirectional_attention": "yes"}, "use_bidirectional_attention"),
    ("qwen2", {"use_sliding_window": "true"}, "use_sliding_window"),
    ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ("gpt_oss", {"sliding_window": 0}, "sliding_window"),
    ("gpt_oss", {"layer_types": ALT[:-1]}, "layer_types"),
]


@pytest.mark.parametrize("model_type,extra,field", REFUSED, ids=[f"{t}-{f}" for t, e, f in REFUSED])
def test_what_cannot_be_honoured_is_refused_naming_the_field(model_type, extra, field, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_file(model_type, extra)))
    with pytest.raises(SpecError, match=rf"config\.json.*'?{field}'?"):
        sg.get_pattern(str(tmp_path))


@pytest.mark.parametrize(
    "model_type,extra,naive",
    [
        ("gemma3_text", {"_sliding_window_pattern": 3}, 3),
        ("cohere2", {"_sliding_window_pattern": 2}, 2),
        ("gemma2", {"sliding_window_pattern": 3}, 3),
    ],
)
def test_the_refused_pattern_fields_are_ones_transformers_reads_otherwise(model_type, extra, naive):
    """Why they are refused: transformers' layers are not the pattern the field states."""
    stated = [None if (i + 1) % naive == 0 else 4096 for i in range(N)]
    assert _transformers(model_type, _file(model_type, extra)) != stated


def test_bidirectional_gemma3_is_not_causal_in_transformers():
    transformers = extras.require("transformers")
    config = transformers.Gemma3TextConfig(use_bidirectional_attention=True, **SHAPE)
    assert config.use_bidirectional_attention and config.sliding_window != 4096  # halved for its masks


# -- Phi-3-Small: blocksparse_* is its attention; a window beside it is never dropped silently ------
PHI3_SMALL = {
    "model_type": "phi3small",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "blocksparse_block_size": 64,
    "blocksparse_num_local_blocks": 16,
    "blocksparse_vert_stride": 8,
    "blocksparse_homo_head_pattern": False,
    "dense_attention_every_n_layers": 2,
}
BESIDE = [
    {"sliding_window": 2048},
    {"layer_types": ["full_attention"] * 32},
    {"max_window_layers": 4},
    {"sliding_window_pattern": 2},
    {"use_sliding_window": True},
    {"use_bidirectional_attention": True},
]


@pytest.mark.parametrize("extra", BESIDE, ids=[next(iter(e)) for e in BESIDE])
def test_phi3small_with_a_window_is_refused_by_pattern_and_loader(extra, tmp_path):
    from sparsegen.models import Phi3SmallConfig

    field = next(iter(extra))
    cfg = {**PHI3_SMALL, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=field):
        sg.get_pattern(str(tmp_path))
    with pytest.raises(CheckpointError, match=field):
        Phi3SmallConfig.from_hf_dict(cfg)
    without = {k: v for k, v in cfg.items() if not k.startswith("blocksparse_")}
    with pytest.raises(SpecError, match=field):
        model_spec_from_hf(without)


def test_phi3small_null_window_fields_are_fine_and_defaults_are_phi3smalls():
    from sparsegen.models import Phi3SmallConfig

    cfg = {**PHI3_SMALL, "sliding_window": None, "use_sliding_window": False}
    assert model_spec_from_hf(cfg).layers == sg.get_pattern("phi3small").layers
    assert Phi3SmallConfig.from_hf_dict(cfg).blocksparse_block_size == 64
    bare = {k: v for k, v in PHI3_SMALL.items() if not k.startswith("blocksparse_")}
    assert model_spec_from_hf(bare).layers == sg.get_pattern("phi3small").layers  # HF's defaults
