"""Tiny random transformers checkpoints whose windows bite inside a 20-token prompt: Mistral
(window 8), Qwen2 (`max_window_layers=1`, window 6), Llama (dense), Gemma-2 (window 8, logit
soft-cap 5) and gpt-oss (window 8, random learned sinks, 4 experts), saved by `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, max_position_embeddings=256)  # fmt: skip


def tiny_configs(head_dim: int = 32) -> dict:
    import transformers as t

    small = {**SMALL, "head_dim": head_dim}
    return {
        "mistral": t.MistralConfig(**small, num_hidden_layers=2, sliding_window=8),
        "qwen2": t.Qwen2Config(
            **small, num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1
        ),
        "llama": t.LlamaConfig(**small, num_hidden_layers=2),
        "gemma2": t.Gemma2Config(
            **small,
            num_hidden_layers=2,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=24,
        ),
        "gpt_oss": t.GptOssConfig(
            **small, num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2
        ),
    }


def write_tiny_checkpoints(root: Path, head_dim: int = 32, names=None) -> dict[str, Path]:
    """name -> folder of each tiny checkpoint (all of `tiny_configs` unless `names` is given)."""
    import transformers

    out = {}
    for name, cfg in tiny_configs(head_dim).items():
        if names is not None and name not in names:
            continue
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        for mname, module in model.named_modules():
            if hasattr(module, "sinks"):  # gpt-oss starts its sinks at 0; random ones matter more
                torch.nn.init.normal_(module.sinks, std=1.0)
            if mname.endswith(("q_proj", "k_proj")):  # scores large enough that Gemma-2's cap bites
                torch.nn.init.normal_(module.weight, std=0.3)
        model.save_pretrained(str(root / name))
        out[name] = root / name
    return out
