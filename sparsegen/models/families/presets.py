"""Random-weight presets of real model sizes, for benchmarks (`--random mistral-7b`, ...): each
is the published `config.json`'s shape and attention fields (no weights; `random_model` draws
them). The windows per layer come from these fields exactly as from the checkpoint's file."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Mistral-7B-v0.1: every layer a 4096-token window
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                       bos_token_id=1, eos_token_id=2),
    # Llama-3-8B: dense, rope base 500000
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      bos_token_id=128000, eos_token_id=128001),
    # Qwen2-7B: use_sliding_window is false in the published file, so every layer is dense
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6, sliding_window=131072,
                     max_window_layers=28, use_sliding_window=False, bos_token_id=151643, eos_token_id=151643),
    # Gemma-2-9B: 4096-token windows on even layers, soft-caps 50 / 30, head_dim 256
    "gemma2-9b": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                      num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                      max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1),
    # gpt-oss-20b: 128-token windows on even layers, learned sinks, 32 experts (top 4)
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=128,
                        num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0, attention_bias=True,
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096},
                        rope_theta=150000.0, eos_token_id=200002, tie_word_embeddings=False),
}  # fmt: skip
