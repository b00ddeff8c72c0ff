"""Phi-3-Small split over `world_size` ranks (Megatron-style tensor parallelism).

What each rank holds (H query heads, Hkv KV heads, G = H / Hkv, D head_dim, F intermediate):
- `query_key_value`, column-parallel **by KV group**: rank r keeps whole groups m in
  [r·Hkv/w, (r+1)·Hkv/w), i.e. query heads G·m .. G·m+G-1 with their k and v. The fused output is
  laid out per group (G queries, k, v), so a rank's rows are one contiguous block.
- `dense` (output projection), row-parallel: the columns of the rank's heads; the partial sums
  are all-reduced, then the bias is added once.
- `up_proj`, column-parallel over the F GeGeLU units. Its 2F outputs are *interleaved* (gate at
  2i, linear at 2i+1), so unit i lives in rows 2i and 2i+1: rank r keeps rows 2·f0 .. 2·f1-1, an
  even-aligned contiguous block, and the plain `gegelu` (`x[..., 0::2]`, `x[..., 1::2]`) pairs
  them correctly on every rank. (Cutting the rows as "first half gate, second half linear"
  would pair the wrong columns.)
- `down_proj`, row-parallel over the same units, with an all-reduce, then the bias.
- `embed_tokens`, replicated: a lookup reads only B rows, so splitting it would buy memory
  (0.8 GB at 7b) with one more all-reduce per step, on the latency path.
- `lm_head`, vocab-parallel: the largest single matrix read every step (0.8 GB at 7b); each rank
  reads 1/w of it and the logits are all-gathered. The gather copies values without arithmetic,
  so every rank holds bitwise the same logits and samples the same tokens: this is what lets
  every rank run the scheduler and the sampler itself (see `sparsegen.parallel.executor`).
- LayerNorms and their biases, replicated.

Each rank's `LayerSpec`s keep the **global** head numbers (DESIGN §1): rank r's heads are
`heads[h0:h1]` of the whole model's layer, so their vertical offsets are those of global heads
h0..h1-1, and each rank compiles kernels for its own head range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from ..models.config import Phi3SmallConfig
from ..models.loader import init_random_
from ..models.memory import check_fits, weight_bytes
from ..models.options import ModelOptions
from ..models.phi3small import Linear, Phi3SmallForCausalLM, model_spec
from ..spec import LayerSpec, ModelSpec
from . import distributed


@dataclass(frozen=True)
class TPShard:
    """Which part of the model one rank holds."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("rank", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"TPShard.{name} must be an int, got {v!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InputError(
                f"TPShard needs 0 <= rank < world_size, got rank {self.rank} of {self.world_size}"
            )

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of `n` equal parts' worth of `what`."""
        if n % self.world_size:
            raise InputError(f"{n} {what} cannot be split evenly over {self.world_size} ranks")
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def vocab_span(self, vocab: int) -> tuple[int, int, int]:
        """(start, stop, rows per rank): rows are ceil(V / w); the last rank's tail is zero padding."""
        per = -(-vocab // self.world_size)
        start = min(self.rank * per, vocab)
        return start, min(start + per, vocab), per


def shard_layer_spec(layer: LayerSpec, shard: TPShard) -> LayerSpec:
    """Rank's heads of `layer` with their global HeadSpecs (global vertical offsets)."""
    k0, k1 = shard.span(layer.num_kv_heads, "KV heads")
    g = layer.group_size
    # replace, not a new LayerSpec: the layer's soft-cap and learned sinks hold for every head
    return dataclasses.replace(
        layer, num_heads=(k1 - k0) * g, num_kv_heads=k1 - k0, heads=layer.heads[k0 * g : k1 * g]
    )


def shard_model_spec(spec: ModelSpec, shard: TPShard) -> ModelSpec:
    name = spec.name if shard.world_size == 1 else f"{spec.name}-tp{shard.world_size}-rank{shard.rank}"
    return ModelSpec(name=name, layers=tuple(shard_layer_spec(layer, shard) for layer in spec.layers))


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W_r^T) + b: W_r is this rank's columns of W, b the whole bias (added
    once, after the reduction; `bias=False`: none)."""

    def __init__(
        self, in_local: int, out_features: int, world_size: int, group=None, device=None, dtype=None,
        bias: bool = True,
    ):  # fmt: skip
        super().__init__()
        self.world_size, self.group = world_size, group
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out]
        y = F.linear(x, self.weight)  # [T, out], this rank's partial sum
        if self.world_size > 1:
            distributed.all_reduce_(y, self.group)
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelLMHead(nn.Module):
    """logits = all_gather(x @ W_r^T): W_r is this rank's rows of the vocabulary (zero-padded)."""

    def __init__(self, hidden: int, vocab: int, shard: TPShard, group=None, device=None, dtype=None):
        super().__init__()
        self.vocab, self.world_size, self.group = vocab, shard.world_size, group
        _, _, per = shard.vocab_span(vocab)
        self.weight = nn.Parameter(torch.empty(per, hidden, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, hidden] -> [B, vocab]
        local = F.linear(x, self.weight)  # [B, V / w]
        if self.world_size == 1:
            return local[:, : self.vocab]
        return distributed.all_gather_rows(local, self.world_size, self.group)[:, : self.vocab]


# How each checkpoint tensor is cut: (dimension, unit) with unit in "kv_group", "head", "ff_pair",
# "ff", "vocab"; tensors not named here are replicated.
_RULES = {
    "self_attn.query_key_value.weight": (0, "kv_group"),
    "self_attn.query_key_value.bias": (0, "kv_group"),
    "self_attn.dense.weight": (1, "head"),
    "mlp.up_proj.weight": (0, "ff_pair"),
    "mlp.up_proj.bias": (0, "ff_pair"),
    "mlp.down_proj.weight": (1, "ff"),
    "lm_head.weight": (0, "vocab"),
}


def shard_rule(name: str) -> tuple[int, str] | None:
    key = name if name == "lm_head.weight" else ".".join(name.split(".")[-3:])
    return _RULES.get(key)


def shard_range(name: str, config: Phi3SmallConfig, shard: TPShard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of tensor `name` that this rank keeps; None: the whole tensor."""
    rule = shard_rule(name)
    if rule is None:
        return None
    dim, unit = rule
    d, g = config.head_dim, config.group_size
    if unit == "kv_group":
        k0, k1 = shard.span(config.num_key_value_heads, "KV heads")
        return dim, k0 * (g + 2) * d, k1 * (g + 2) * d
    if unit == "head":
        k0, k1 = shard.span(config.num_key_value_heads, "KV heads")
        return dim, k0 * g * d, k1 * g * d
    f0, f1 = shard.span(config.ff_intermediate_size, "GeGeLU units")
    if unit == "ff_pair":
        return dim, 2 * f0, 2 * f1
    if unit == "ff":
        return dim, f0, f1
    v0, v1, _ = shard.vocab_span(config.vocab_size)
    return dim, v0, v1


def full_shape(name: str, local: torch.Tensor, config: Phi3SmallConfig, shard: TPShard) -> tuple[int, ...]:
    """The unsharded shape of tensor `name`, whose local part is `local`."""
    shape = list(local.shape)
    rule = shard_rule(name)
    if rule is not None:
        dim, unit = rule
        shape[dim] = config.vocab_size if unit == "vocab" else shape[dim] * shard.world_size
    return tuple(shape)


def take_shard(
    name: str, full, config: Phi3SmallConfig, shard: TPShard, local: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's part of `full` (a tensor, or a safetensors `get_slice` of a sharded one),
    padded to `local`'s shape."""
    return cut_padded(full, shard_range(name, config, shard), local)


def cut_padded(full, rng: tuple[int, int, int] | None, local: torch.Tensor | None = None) -> torch.Tensor:
    """full[..., start:stop, ...] along `dim` of rng = (dim, start, stop) (None: `full` itself),
    zero-padded at the end of `dim` to `local`'s shape (the vocabulary's padded tail)."""
    if rng is None:
        return full
    dim, start, stop = rng
    index = (slice(None),) * dim + (slice(start, stop),)
    part = full[index]
    if local is not None and tuple(part.shape) != tuple(local.shape):  # the vocabulary's padded tail
        padded = torch.zeros(tuple(local.shape), dtype=part.dtype, device=part.device)
        padded[(slice(None),) * dim + (slice(0, part.shape[dim]),)] = part
        part = padded
    return part


def set_rank_spec(model, global_spec: ModelSpec) -> None:
    """A rank's model (either kind) takes `global_spec`: its own heads' share of each layer."""
    model.global_spec = global_spec
    model.spec = shard_model_spec(global_spec, model.shard)
    for block, layer in zip(model.model.layers, model.spec.layers, strict=True):
        block.self_attn.layer = layer


def tie_rank_embeddings(model) -> None:
    """A rank's lm_head = its rows of the (replicated) embedding: a view when V divides."""
    emb = model.model.embed_tokens.weight
    v0, v1, per = model.shard.vocab_span(model.config.vocab_size)
    with torch.no_grad():
        if v1 - v0 == per:
            model.lm_head.weight = nn.Parameter(emb[v0:v1], requires_grad=False)
        else:
            model.lm_head.weight.zero_()
            model.lm_head.weight[: v1 - v0] = emb[v0:v1]


def check_rank(config, shard: TPShard, options: ModelOptions, units: int, what: str) -> tuple[int, int, int]:
    """Before a rank builds its model (either kind): the TP size divides the KV heads and the
    MLP's `units` (`what` names them), and the rank's weights (its share, the embedding whole)
    fit. Returns (hkv, h, units per rank): this rank's KV heads, query heads and MLP units."""
    distributed.check_tp_size(shard.world_size, config.num_key_value_heads, "cpu")
    shard.span(units, what)
    w = shard.world_size
    embed = config.vocab_size * config.hidden_size * torch.empty((), dtype=options.dtype).element_size()
    check_fits(
        (weight_bytes(config, options.dtype) - embed) // w + embed,
        options.device,
        f"rank {shard.rank}'s weights (1/{w} of the model; the embedding whole)",
    )
    k0, k1 = shard.span(config.num_key_value_heads, "KV heads")
    return k1 - k0, (k1 - k0) * config.group_size, units // w


class TensorParallelPhi3Small(Phi3SmallForCausalLM):
    """One rank's Phi-3-Small: the same module tree and tensor names, each sharded tensor
    holding this rank's part. Forward is the parent's; sharded modules do the collectives."""

    def __init__(
        self,
        config: Phi3SmallConfig,
        shard: TPShard,
        options: ModelOptions | None = None,
        *,
        group=None,
        **fields,
    ):
        """`options` (or ModelOptions fields as keywords) as for `Phi3SmallForCausalLM`;
        `group`: the torch.distributed group of the collectives (None: the default group)."""
        options = ModelOptions.of(options, **fields)
        hkv, h, f = check_rank(config, shard, options, config.ff_intermediate_size, "GeGeLU units")
        # The whole tree is built on the CPU first: parameters are allocated but never written
        # (layers._NoInit), so the unsharded matrices cost address space, not memory, and are
        # replaced below before anything touches them.
        super().__init__(config, dataclasses.replace(options, device=torch.device("cpu")))
        self.shard = shard
        self.global_spec = self.spec
        self.spec = shard_model_spec(self.global_spec, shard)
        fk = {"device": options.device, "dtype": options.dtype}
        hidden, d, w = config.hidden_size, config.head_dim, shard.world_size
        for block, layer in zip(self.model.layers, self.spec.layers, strict=True):
            attn = block.self_attn
            attn.num_heads, attn.num_kv_heads, attn.layer = h, hkv, layer
            attn.query_key_value = Linear(hidden, (h + 2 * hkv) * d, bias=True, **fk)
            attn.dense = RowParallelLinear(h * d, hidden, w, group, **fk)
            block.mlp.up_proj = Linear(hidden, 2 * f, bias=True, **fk)
            block.mlp.down_proj = RowParallelLinear(f, hidden, w, group, **fk)
        self.lm_head = VocabParallelLMHead(hidden, config.vocab_size, shard, group, **fk)
        self.to(options.device)  # the replicated parts: embedding, LayerNorms, rotary, dummy ids
        self.options = options  # the tree was built with device cpu
        self.eval().requires_grad_(False)

    @property
    def local_num_kv_heads(self) -> int:
        k0, k1 = self.shard.span(self.config.num_key_value_heads, "KV heads")
        return k1 - k0

    def set_force_dense(self, force_dense: bool) -> None:
        set_rank_spec(self, model_spec(self.config, force_dense))

    def tie_embeddings(self) -> None:
        tie_rank_embeddings(self)


def random_tp_model(
    config: Phi3SmallConfig,
    shard: TPShard,
    options: ModelOptions | None = None,
    *,
    seed: int = 0,
    group=None,
    **fields,
) -> TensorParallelPhi3Small:
    """This rank's part of exactly the weights `loader.random_model` draws with `seed`: every
    full tensor is drawn in the same order on the device, then cut (one full tensor at a time)."""
    model = TensorParallelPhi3Small(config, shard, options, group=group, **fields)
    gen = torch.Generator(device=model.options.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = torch.empty(full_shape(name, param, config, shard), device=param.device, dtype=param.dtype)
            init_random_(name, full, gen)
            param.copy_(take_shard(name, full, config, shard, param))
            del full
    return model
