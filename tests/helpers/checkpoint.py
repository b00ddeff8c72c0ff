"""Write tiny random Phi-3-Small checkpoints in the real HF format, for the CPU tests.

The config is written field by field as in Phi-3-Small's own `config.json` (with small sizes
and 16-token sparse blocks), and the tensors under the checkpoint's real names, including a
`rotary_emb.inv_freq` buffer that loaders must skip. Values are random, never zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_HF_CONFIG = {
    "architectures": ["Phi3SmallForCausalLM"],
    "model_type": "phi3small",
    "attention_dropout_prob": 0.0,
    "blocksparse_block_size": 16,
    "blocksparse_homo_head_pattern": False,
    "blocksparse_num_local_blocks": 2,
    "blocksparse_triton_kernel_block_size": 16,
    "blocksparse_vert_stride": 4,
    "bos_token_id": 256,
    "dense_attention_every_n_layers": 2,
    "dummy_token_indices": list(range(261, 272)),
    "embedding_dropout_prob": 0.1,
    "eos_token_id": 256,
    "ff_dim_multiplier": None,
    "ff_intermediate_size": 512,
    "ffn_dropout_prob": 0.1,
    "gegelu_limit": 20.0,
    "gegelu_pad_to_256": True,
    "hidden_act": "gegelu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "max_position_embeddings": 4096,
    "mup_attn_multiplier": 1.0,
    "mup_embedding_multiplier": 10.0,
    "mup_use_scaling": True,
    "mup_width_multiplier": 8.0,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pad_sequence_to_multiple_of_64": True,
    "reorder_and_upcast_attn": False,
    "rope_embedding_base": 10000,
    "rope_position_scale": 1.0,
    "rope_scaling": None,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 272,
}


def tensor_shapes(cfg: dict, with_lm_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint for `cfg`, by its real name."""
    hidden, vocab, ff = cfg["hidden_size"], cfg["vocab_size"], cfg["ff_intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    qkv = (heads + 2 * kv_heads) * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "input_layernorm.bias": (hidden,),
                p + "self_attn.query_key_value.weight": (qkv, hidden),
                p + "self_attn.query_key_value.bias": (qkv,),
                p + "self_attn.dense.weight": (hidden, hidden),
                p + "self_attn.dense.bias": (hidden,),
                p + "self_attn.rotary_emb.inv_freq": (head_dim // 2,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.bias": (hidden,),
                p + "mlp.up_proj.weight": (2 * ff, hidden),
                p + "mlp.up_proj.bias": (2 * ff,),
                p + "mlp.down_proj.weight": (hidden, ff),
                p + "mlp.down_proj.bias": (hidden,),
            }
        )
    shapes["model.final_layernorm.weight"] = (hidden,)
    shapes["model.final_layernorm.bias"] = (hidden,)
    if with_lm_head:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def random_tensors(cfg: dict, seed: int = 0, with_lm_head: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(cfg, with_lm_head).items():
        x = torch.randn(shape, generator=gen)
        if name.endswith("layernorm.weight"):
            x = 1.0 + 0.1 * x
        elif name.endswith(".bias"):
            x = 0.02 * x
        elif name == "model.embed_tokens.weight":
            x = 0.1 * x
        elif name.endswith("inv_freq"):
            x = x.abs()
        else:
            x = x * shape[1] ** -0.5
        out[name] = x.contiguous()
    return out


def write_checkpoint(
    folder: str | Path,
    *,
    cfg: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    shards: int = 1,
    with_lm_head: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """config.json + model.safetensors, or `shards` files with model.safetensors.index.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_HF_CONFIG if cfg is None else cfg)
    if tensors is None:
        tensors = random_tensors(cfg, seed, with_lm_head)
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def write_bpe_file(path: str | Path) -> Path:
    """A tiny byte-level BPE: the 256 single bytes plus a few merges, in `.tiktoken` format."""
    import base64

    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world"]
    tokens = [bytes([i]) for i in range(256)] + merges
    path = Path(path)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path
