"""Tiny random checkpoints of the decoder families, written with transformers' own
`save_pretrained` (float32), and transformers' greedy tokens and logits for them: the oracle
the family tests compare sparsegen with."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.extras import require

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False)  # fmt: skip
# per family: transformers' config class and what sets its tiny checkpoint apart (small windows
# that bite inside a 20-token prompt, biases, rope variants)
FAMILY_CASES = {
    "llama": (
        "LlamaConfig",
        dict(
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),  # fmt: skip
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": (
        "Qwen3Config",
        dict(
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),  # fmt: skip
    "gemma2": (
        "Gemma2Config",
        dict(
            sliding_window=8,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=48,
            final_logit_softcapping=4.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0),
    ),
}


def hf_model(family: str, seed: int = 0):
    transformers = require("transformers")
    cls_name, extra = FAMILY_CASES[family]
    config = getattr(transformers, cls_name)(**TINY, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # biases and norm weights away from their init values, so they count
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # sharper attention: rope and windows count
                p.mul_(4.0)
            if name.endswith(("bias", "norm.weight", "sinks")):
                p.normal_(
                    1.0 if name.endswith("norm.weight") else 0.0, 1.0 if name.endswith("sinks") else 0.2
                )
    return model.float().eval()


def write_family_checkpoint(folder: Path, family: str, seed: int = 0):
    """(folder, the transformers model) for `family`'s tiny random checkpoint."""
    model = hf_model(family, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder), model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:  # [len(prompt), vocab] float32
    with torch.no_grad():
        return model(torch.tensor([prompt], device=model.device)).logits[0].float()
