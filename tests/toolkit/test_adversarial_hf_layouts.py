"""Each layer's attention as sparsegen maps an HF config, against transformers' own reading of the
same fields (its config class for the `model_type`, then what its model does with the result):
random configs mixing every layout field (`sliding_window`, `use_sliding_window`,
`max_window_layers`, both pattern keys, `layer_types`), for every family sparsegen maps.

Either sparsegen reads each layer as transformers does, or it refuses with a SpecError naming
the field it cannot honour; it never maps a layer another way.
"""

from __future__ import annotations

import logging
import random
import re
import warnings

import pytest
from helpers.extras import require

from sparsegen.errors import SpecError
from sparsegen.presets import from_hf_config

transformers = require("transformers")

CLASSES = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "ministral": "MinistralConfig", "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig", "cohere2": "Cohere2Config", "gpt_oss": "GptOssConfig",
}  # fmt: skip
LAYOUT_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
               "_sliding_window_pattern", "layer_types")  # fmt: skip


def transformers_windows(model_type: str, cfg: dict) -> list[int | None]:
    """Per layer, the window transformers' model applies (None: full causal attention)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.getLogger("transformers").level
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            c = getattr(transformers, CLASSES[model_type])(
                **{k: v for k, v in cfg.items() if k != "model_type"}
            )
        finally:
            logging.getLogger("transformers").setLevel(level)
    n, window = c.num_hidden_layers, getattr(c, "sliding_window", None) or None
    if model_type == "llama":
        return [None] * n
    if model_type in ("mistral", "qwen3_moe"):  # their models window every layer or none
        return [window] * n
    return [window if t == "sliding_attention" else None for t in c.layer_types]


def sparsegen_windows(cfg: dict) -> list[int | None]:
    out = []
    for layer in from_hf_config(cfg).layers:
        assert len({(h.dense, h.sliding_window) for h in layer.heads}) == 1  # one kind per layer
        h = layer.heads[0]
        assert h.dense == (h.sliding_window == 0) and not h.local_blocks and not h.vert_stride
        out.append(h.sliding_window or None)
    return out


def random_config(rng: random.Random) -> dict:
    model_type = rng.choice(sorted(CLASSES))
    n = rng.choice([1, 2, 3, 4, 6, 7, 12])
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 100}  # fmt: skip
    if rng.random() < 0.6:
        cfg["sliding_window"] = rng.choice([None, 1, 8, 4096, 100000])
    if rng.random() < 0.4:
        cfg["use_sliding_window"] = rng.choice([True, False])
    if rng.random() < 0.3:
        cfg["max_window_layers"] = rng.choice([0, 1, 2, 28])
    for key in ("sliding_window_pattern", "_sliding_window_pattern"):
        if rng.random() < 0.3:
            cfg[key] = rng.choice([1, 2, 3, 6])
    if rng.random() < 0.3:
        cfg["layer_types"] = [rng.choice(["full_attention", "sliding_attention"]) for _ in range(n)]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if model_type == "gpt_oss":
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    return cfg


def check_same_or_refused(cfg: dict) -> str:
    theirs = transformers_windows(cfg["model_type"], cfg)
    try:
        ours = sparsegen_windows(cfg)
    except SpecError as exc:
        named = re.findall(r"'([a-z_]+)'", str(exc))
        assert str(exc).startswith("config.json") and set(named) & set(LAYOUT_KEYS), (cfg, str(exc))
        return "refused"
    assert ours == theirs, (cfg, "transformers", theirs, "sparsegen", ours)
    return "same"


@pytest.mark.parametrize("chunk", range(12))
def test_random_layouts_read_as_transformers_reads_them(chunk):
    rng = random.Random(chunk)
    outcomes = [check_same_or_refused(random_config(rng)) for _ in range(25)]
    assert outcomes.count("same") >= 10, outcomes  # most random layouts are honoured, not refused


CASES = [  # (model_type, fields): the MoE Qwens' own rules, and Mistral's two readings of layer_types
    ("qwen2_moe", dict(num_hidden_layers=6, use_sliding_window=True)),  # even layers below 28
    ("qwen2_moe", dict(num_hidden_layers=6, use_sliding_window=True, max_window_layers=3, sliding_window=8)),
    ("qwen2_moe", dict(num_hidden_layers=4, use_sliding_window=False)),
    ("qwen2_moe", dict(num_hidden_layers=3, use_sliding_window=True, layer_types=["full_attention",
                                                                                 "sliding_attention",
                                                                                 "sliding_attention"])),
    ("qwen3_moe", dict(num_hidden_layers=5, use_sliding_window=True, max_window_layers=2)),  # every layer
    ("qwen3_moe", dict(num_hidden_layers=5, use_sliding_window=False, sliding_window=8)),
    ("mistral", dict(num_hidden_layers=3, sliding_window=8, layer_types=["sliding_attention"] * 3)),
]  # fmt: skip


@pytest.mark.parametrize("model_type,fields", CASES)
def test_moe_qwens_and_mistral_as_transformers(model_type, fields):
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 100, **fields}  # fmt: skip
    assert sparsegen_windows(cfg) == transformers_windows(model_type, cfg)


REFUSED = [  # transformers' config and model disagree, or the model would see no key at all
    ("qwen2_moe", dict(num_hidden_layers=2, use_sliding_window=False,
                       layer_types=["sliding_attention", "full_attention"]), "window of 0 keys"),
    ("qwen3_moe", dict(num_hidden_layers=2, use_sliding_window=True,
                       layer_types=["sliding_attention", "full_attention"]), "qwen3_moe model ignores it"),
    ("mistral", dict(num_hidden_layers=2, sliding_window=8, layer_types=["full_attention"] * 2),
     "disagrees with 'sliding_window'"),
]  # fmt: skip


@pytest.mark.parametrize("model_type,fields,match", REFUSED)
def test_ambiguous_layouts_are_refused_naming_the_field(model_type, fields, match):
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 100, **fields}  # fmt: skip
    with pytest.raises(SpecError, match=match) as info:
        from_hf_config(cfg)
    assert "'layer_types'" in str(info.value)
