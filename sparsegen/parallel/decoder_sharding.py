"""A decoder family (Llama, Mistral, Qwen2/3, Gemma-2/3, gpt-oss) split over `world_size` ranks, the
way `sharding` splits Phi-3-Small (H query heads, Hkv KV heads, G = H / Hkv, D head_dim, F
intermediate):

- the fused `qkv_proj` (and its bias), column-parallel **by KV group**: its rows are Hkv slots of
  (G queries, k, v) (`families.fused`), so rank r's whole groups [r·Hkv/w, (r+1)·Hkv/w) are one
  contiguous block of rows. From a checkpoint, rank r reads q_proj's rows of its query heads and
  k_proj's / v_proj's of its KV heads and places them by the same `qkv_rows` permutation, for its
  own head counts.
- `o_proj`, row-parallel over the rank's heads: one all-reduce, then the bias (if any) once.
- `gate_up_proj` (gate and up interleaved), column-parallel over the F units: rows 2·f0 .. 2·f1-1;
  from a checkpoint, gate_proj's and up_proj's rows f0 .. f1-1. `down_proj` row-parallel over the
  same units, with one all-reduce.
- per-head q/k norms (Qwen3, Gemma-3) act on one head at a time: replicated. Learned sinks
  (gpt-oss) are one logit per query head: cut like the heads.
- gpt-oss's experts: every rank keeps every expert with its share of F (gate_up columns
  2·f0 .. 2·f1-1, down_proj rows f0 .. f1-1); the router is replicated, so every rank routes
  every token alike; the mixture's output is all-reduced, and the down_proj bias is added by
  rank 0 only.
- the embedding, its scale, every RMSNorm and the final one, replicated; `lm_head`
  vocab-parallel with the logits all-gathered (bitwise the same on every rank), then Gemma's
  final soft-cap, elementwise, on every rank.

Each rank's LayerSpecs keep the global head numbers (`sharding.shard_model_spec`), so windows,
soft-caps and sinks per head follow their heads. `shard_range`, `full_shape` and `take_shard`
have `sharding`'s signatures, for the decoders' tensor names (the model's and the checkpoint's).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch import nn

from ..models.families.config import DecoderConfig
from ..models.families.fused import Rows, checkpoint_params
from ..models.families.model import DecoderForCausalLM, decoder_spec
from ..models.families.moe import MixtureOfExperts
from ..models.layers import Linear
from ..models.loader import init_random_
from ..models.options import ModelOptions
from . import distributed
from .sharding import (
    RowParallelLinear,
    TPShard,
    VocabParallelLMHead,
    check_rank,
    cut_padded,
    set_rank_spec,
    shard_model_spec,
    tie_rank_embeddings,
)

# Tensor-name suffix -> (dimension, unit). Units: "kv_group" (G + 2 rows of D per KV head), "head"
# (G D per KV head: query rows or o_proj columns), "qhead" (G per KV head: sinks), "kv" (D per KV
# head), "ff_pair" (2 per unit, interleaved gate / up), "ff" (1 per unit), "vocab". Anything not
# named is replicated.
_RULES = {
    "self_attn.qkv_proj.weight": (0, "kv_group"),
    "self_attn.qkv_proj.bias": (0, "kv_group"),
    "self_attn.q_proj.weight": (0, "head"),
    "self_attn.q_proj.bias": (0, "head"),
    "self_attn.k_proj.weight": (0, "kv"),
    "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "head"),
    "self_attn.sinks": (0, "qhead"),
    "mlp.gate_up_proj.weight": (0, "ff_pair"),
    "mlp.gate_up_proj.bias": (0, "ff_pair"),
    "mlp.gate_proj.weight": (0, "ff"),
    "mlp.gate_proj.bias": (0, "ff"),
    "mlp.up_proj.weight": (0, "ff"),
    "mlp.up_proj.bias": (0, "ff"),
    "mlp.down_proj.weight": (1, "ff"),
    "mlp.experts.gate_up_proj": (2, "ff_pair"),  # [E, hidden, 2F]
    "mlp.experts.gate_up_proj_bias": (1, "ff_pair"),  # [E, 2F]
    "mlp.experts.down_proj": (1, "ff"),  # [E, F, hidden]
}


def shard_rule(name: str) -> tuple[int, str] | None:
    if name == "lm_head.weight":
        return 0, "vocab"
    for n in (3, 2):
        rule = _RULES.get(".".join(name.split(".")[-n:]))
        if rule is not None:
            return rule
    return None


def shard_range(name: str, config: DecoderConfig, shard: TPShard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of tensor `name` that this rank keeps; None: the whole tensor."""
    rule = shard_rule(name)
    if rule is None:
        return None
    dim, unit = rule
    if unit == "vocab":
        v0, v1, _ = shard.vocab_span(config.vocab_size)
        return dim, v0, v1
    if unit in ("ff_pair", "ff"):
        f0, f1 = shard.span(config.intermediate_size, "intermediate_size units")
        n = 2 if unit == "ff_pair" else 1
        return dim, n * f0, n * f1
    k0, k1 = shard.span(config.num_key_value_heads, "KV heads")
    d, g = config.head_dim, config.group_size
    per = {"kv_group": (g + 2) * d, "head": g * d, "qhead": g, "kv": d}[unit]
    return dim, k0 * per, k1 * per


def full_shape(name: str, local, config: DecoderConfig, shard: TPShard) -> tuple[int, ...]:
    """The unsharded shape of tensor `name`, whose local part (a tensor or `Rows`) is `local`."""
    shape = list(local.shape)
    rule = shard_rule(name)
    if rule is not None:
        dim, unit = rule
        shape[dim] = config.vocab_size if unit == "vocab" else shape[dim] * shard.world_size
    return tuple(shape)


def take_shard(name: str, full, config: DecoderConfig, shard: TPShard, local=None) -> torch.Tensor:
    """This rank's part of `full` (a tensor, or a safetensors `get_slice`), padded to `local`'s shape."""
    return cut_padded(full, shard_range(name, config, shard), local)


class ShardedMixtureOfExperts(MixtureOfExperts):
    """gpt-oss's mixture over this rank's share of every expert's F units, all-reduced."""

    def __init__(self, moe: MixtureOfExperts, f_local: int, shard: TPShard, group, fk: dict):
        nn.Module.__init__(self)
        self.top_k, self.router, self.experts = moe.top_k, moe.router, moe.experts  # router: replicated
        self.world_size, self.group = shard.world_size, group
        ex = self.experts
        e, h = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[1]
        ex.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * f_local, **fk))  # [E, hidden, 2F/w]
        ex.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f_local, **fk))  # [E, 2F/w]
        ex.down_proj = nn.Parameter(torch.empty(e, f_local, h, **fk))  # [E, F/w, hidden]
        ex.down_proj_bias = nn.Parameter(torch.empty(e, h, **fk))  # [E, hidden], whole
        ex.down_bias_on = shard.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden] -> [T, hidden]
        out = super().forward(x)  # this rank's partial sum
        if self.world_size > 1:
            distributed.all_reduce_(out, self.group)
        return out


class TensorParallelDecoder(DecoderForCausalLM):
    """One rank's decoder: the module tree and tensor names of `DecoderForCausalLM`, each sharded
    tensor holding this rank's part. Forward is the parent's; sharded modules do the collectives."""

    def __init__(self, config: DecoderConfig, shard: TPShard, options: ModelOptions | None = None, *,
                 group=None, **fields):  # fmt: skip
        options = ModelOptions.of(options, **fields)
        hkv, h, f = check_rank(config, shard, options, config.intermediate_size, "intermediate_size units")
        # built on the CPU first, never initialised (layers._NoInit): the unsharded matrices cost
        # address space, and are replaced below before anything reads them
        super().__init__(config, dataclasses.replace(options, device=torch.device("cpu")))
        self.shard = shard
        self.global_spec = self.spec
        self.spec = shard_model_spec(self.global_spec, shard)
        fk = {"device": options.device, "dtype": options.dtype}
        hidden, d, w = config.hidden_size, config.head_dim, shard.world_size
        # the local sizes that place the checkpoint's q/k/v and gate/up rows (`checkpoint_params`)
        self.local_sizes = SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv, head_dim=d,
                                           intermediate_size=f)  # fmt: skip
        for block, layer in zip(self.model.layers, self.spec.layers, strict=True):
            attn = block.self_attn
            attn.num_heads, attn.num_kv_heads, attn.layer = h, hkv, layer
            attn.qkv_proj = Linear(hidden, (h + 2 * hkv) * d, bias=config.qkv_bias, **fk)
            attn.o_proj = RowParallelLinear(h * d, hidden, w, group, bias=config.o_bias, **fk)
            if config.sinks:
                attn.sinks = nn.Parameter(torch.empty(h, **fk))  # [H / w] this rank's heads' sinks
            if config.num_experts:
                block.mlp = ShardedMixtureOfExperts(block.mlp, f, shard, group, fk)
            else:
                block.mlp.gate_up_proj = Linear(hidden, 2 * f, bias=config.mlp_bias, **fk)
                block.mlp.down_proj = RowParallelLinear(f, hidden, w, group, bias=config.mlp_bias, **fk)
        self.lm_head = VocabParallelLMHead(hidden, config.vocab_size, shard, group, **fk)
        self.to(options.device)  # the replicated parts: embedding, norms, router, rotary tables
        self.options = options
        self.eval().requires_grad_(False)

    @property
    def local_num_kv_heads(self) -> int:
        return self.local_sizes.num_key_value_heads

    def checkpoint_params(self) -> dict[str, nn.Parameter | Rows]:
        """Checkpoint name -> what it fills: the local fused q/k/v and gate/up rows of this
        rank's heads and units (each read as that rank's slice of the checkpoint tensor)."""
        return checkpoint_params(self, self.local_sizes)

    def set_force_dense(self, force_dense: bool) -> None:
        set_rank_spec(self, decoder_spec(self.config, force_dense))

    def tie_embeddings(self) -> None:
        tie_rank_embeddings(self)


def random_tp_decoder(config: DecoderConfig, shard: TPShard, options: ModelOptions | None = None, *,
                      seed: int = 0, group=None, **fields) -> TensorParallelDecoder:  # fmt: skip
    """This rank's part of exactly the weights `loader.random_model` draws with `seed`: every full
    tensor drawn in the model's parameter order, then cut."""
    model = TensorParallelDecoder(config, shard, options, group=group, **fields)
    gen = torch.Generator(device=model.options.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = torch.empty(full_shape(name, param, config, shard), device=param.device, dtype=param.dtype)
            init_random_(name, full, gen)
            param.copy_(take_shard(name, full, config, shard, param))
            del full
    return model
