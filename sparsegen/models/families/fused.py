"""The decoder families' fused weights, loaded from the checkpoint's separate tensors.

A family's attention holds one `qkv_proj` whose rows are Hkv slots of G query heads, then k,
then v (`models.attention`'s layout, Phi-3-Small's), and its MLP one `gate_up_proj` whose rows
interleave gate and up (row 2f: gate f, 2f + 1: up f), the layout the fused GeGeLU / SwiGLU
epilogues read. The checkpoint keeps transformers' names (`q_proj`, `k_proj`, `v_proj`,
`gate_proj`, `up_proj`, with their biases): `checkpoint_params` maps each of those names to the
rows of the fused parameter it fills (`Rows`), so the loader reads and checks every tensor by
its own name and shape. The rows are a permutation, so the fused projection computes each
output exactly as the separate one did.
"""

from __future__ import annotations

import torch
from torch import nn


class Rows:
    """Rows `index` ([n] int64) of a fused parameter, seen as the checkpoint tensor that fills them."""

    def __init__(self, param: nn.Parameter, index: torch.Tensor):
        self.param, self.index = param, index

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.index.numel(), *self.param.shape[1:]))

    def copy_(self, src: torch.Tensor) -> None:
        p = self.param.data
        p.index_copy_(0, self.index.to(p.device), src.to(device=p.device, dtype=p.dtype))


def qkv_rows(heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """The fused QKV rows of q_proj's, k_proj's and v_proj's rows ([H D], [Hkv D], [Hkv D] int64):
    query head i = j G + r (KV group j) lands in slot j (G + 2) + r, key j in j (G + 2) + G and
    value j in j (G + 2) + G + 1."""
    g = heads // kv_heads
    slot = torch.arange(kv_heads)[:, None] * (g + 2)  # [Hkv, 1]: each group's first slot
    e = torch.arange(head_dim)

    def rows(slots: torch.Tensor) -> torch.Tensor:  # slots: [Hkv, n] -> [Hkv n D]
        return (slots[..., None] * head_dim + e).reshape(-1)

    return rows(slot + torch.arange(g)), rows(slot + g), rows(slot + g + 1)


def gate_up_rows(intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused gate/up rows of gate_proj's and up_proj's rows ([F] int64 each)."""
    f = torch.arange(intermediate)
    return 2 * f, 2 * f + 1


def checkpoint_params(model: nn.Module, config) -> dict[str, nn.Parameter | Rows]:
    """Every checkpoint tensor name of a family model -> the parameter (or fused rows) it fills."""
    q, k, v = qkv_rows(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    gate, up = gate_up_rows(config.intermediate_size)
    out: dict[str, nn.Parameter | Rows] = {}
    for name, param in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
        if prefix.endswith(".self_attn.qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            for proj, index in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{base}{proj}.{leaf}"] = Rows(param, index)
        elif prefix.endswith(".mlp.gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            for proj, index in (("gate_proj", gate), ("up_proj", up)):
                out[f"{base}{proj}.{leaf}"] = Rows(param, index)
        else:
            out[name] = param
    return out
