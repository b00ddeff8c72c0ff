"""Phi-3-Small (DESIGN §2) as a plain PyTorch module whose attention is sparsegen's.

Module names equal the checkpoint's tensor names (`model.layers.N.self_attn.query_key_value`,
...), so `state_dict()` *is* the HF layout. Attention (`models.attention`) goes only through
`sparsegen.prefill` / `sparsegen.paged_decode`, each layer with its own `LayerSpec`: compiled
kernels on a GPU, the reference on a CPU. Tokens are flattened: activations are `[T, hidden]`
for T tokens of a batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..errors import InputError
from ..kernels.fused import gegelu as gegelu_kernel
from ..kernels.linear import gemm_rows as rows_kernel
from ..kernels.linear import gemv as gemv_kernel
from ..presets import from_hf_config
from ..spec import HeadSpec, LayerSpec, ModelSpec
from .attention import Attention, KVCacheLayer
from .batch import ForwardBatch
from .causal_lm import CausalLM
from .config import Phi3SmallConfig
from .layers import (
    Embedding,
    Linear,
    add_norm,
    fast_kernels,
    gegelu,
    gemv_layer,
    gemv_row,
    linear,
    rows_gemm,
)  # fmt: skip
from .options import ATTN_IMPLS, ModelOptions
from .rope import Rotary

__all__ = ["ATTN_IMPLS", "KVCacheLayer", "Phi3SmallForCausalLM", "gegelu", "model_spec"]


def model_spec(config: Phi3SmallConfig, force_dense: bool = False) -> ModelSpec:
    """Each layer's LayerSpec from the config's blocksparse_* fields (or all dense)."""
    spec = from_hf_config(config.to_hf_dict(), name="phi3small")
    if not force_dense:
        return spec
    dense = tuple(
        LayerSpec(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            heads=(HeadSpec(dense=True),) * layer.num_heads,
        )
        for layer in spec.layers
    )
    return ModelSpec(name="phi3small-dense", layers=dense)


def check_sampled(batch: ForwardBatch) -> None:
    """The sampled_* tables agree with logits_index (shapes and dtypes only: no device read), and
    the batch writes the cache that the last layer's attention then reads."""
    rows, tables, lens = batch.logits_index, batch.sampled_block_tables, batch.sampled_seq_lens
    if batch.slot_mapping is None:
        raise InputError("a prefill with sampled_* tables must write the KV cache: slot_mapping is None")
    if tables is None or lens is None or tables.dim() != 2 or lens.dim() != 1 or rows.dim() != 1:
        shapes = [None if t is None else tuple(t.shape) for t in (tables, lens)]
        raise InputError(f"sampled_block_tables must be [R, pages] and sampled_seq_lens [R], got {shapes}")
    if not rows.shape[0] == lens.shape[0] == tables.shape[0]:
        raise InputError(f"{rows.shape[0]} logits rows, {lens.shape[0]} sampled_seq_lens and "
                         f"{tables.shape[0]} sampled_block_tables rows: they must agree")  # fmt: skip
    if tables.dtype != torch.int32 or lens.dtype != torch.int32:
        raise InputError(f"sampled_* tables must be int32, got {tables.dtype} and {lens.dtype}")


class MLP(nn.Module):
    def __init__(self, config: Phi3SmallConfig, options: ModelOptions, fk: dict):
        super().__init__()
        self.limit = config.gegelu_limit
        self.fused = options.attn_impl != "reference"  # the fused GeGeLU kernel, on a GPU
        self.gemv = options.gemv_on
        self.up_proj = Linear(config.hidden_size, 2 * config.ff_intermediate_size, bias=True, **fk)
        self.down_proj = Linear(  # in-major unless built for the Triton GEMV (see Linear)
            config.ff_intermediate_size, config.hidden_size, bias=True, in_major=not options.gemv_on, **fk
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        if gemv_row(self.gemv, x):  # one kernel: up_proj, its bias and GeGeLU
            act = gemv_kernel.gemv(
                x, self.up_proj.weight, self.up_proj.bias, gegelu_limit=self.limit
            )  # [1, F]
            return linear(self.down_proj, act, True)
        if rows_gemm(self.up_proj, x, self.fused):  # 2..32 rows: one kernel, up_proj and GeGeLU
            act = rows_kernel.gemm_rows(
                x, self.up_proj.weight, self.up_proj.bias, gegelu_limit=self.limit
            )  # [T, F]
            return linear(self.down_proj, act, False, self.fused)
        up = self.up_proj(x)  # [T, 2 * F], gate and linear columns interleaved
        if self.fused and fast_kernels(x):
            act = gegelu_kernel.gegelu(up, self.limit)  # [T, F]
        else:
            act = gegelu(up, self.limit)
        return linear(self.down_proj, act, False, self.fused)


class DecoderLayer(nn.Module):
    """Pre-LN block. It takes and returns the residual stream apart from the block's output, so
    that each residual add is done together with the LayerNorm that follows it (`add_norm`)."""

    def __init__(self, config: Phi3SmallConfig, layer: LayerSpec, options: ModelOptions, fk: dict):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.fused = options.attn_impl != "reference"
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, **fk)
        self.self_attn = Attention(config, layer, options, fk)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, **fk)
        self.mlp = MLP(config, options, fk)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous block's output (the embeddings for block 0)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before x is added; None for block 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCacheLayer | None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this block's MLP output, the stream before it)
        """`rows` ([R] int64): only these rows leave the block (both outputs [R, hidden]); every
        token's K/V is still written (Attention.forward)."""
        plain = isinstance(self.self_attn.query_key_value, nn.Linear) and isinstance(
            self.mlp.up_proj, nn.Linear
        )
        if rows is None and plain and gemv_row(self.self_attn.gemv, x):
            return self._forward_row(x, residual, cos, sin, batch, kv_cache)
        trigger = rows_gemm(self.self_attn.query_key_value, x, self.fused)  # as below, for QKV
        h, residual = add_norm(self.input_layernorm, x, residual, self.fused, trigger)
        attn = self.self_attn(h, cos, sin, batch, kv_cache, rows)
        if rows is not None:
            residual = residual[rows]  # [R, hidden]
            if rows.shape[0] == 0:
                return attn, residual
        trigger = rows_gemm(self.mlp.up_proj, attn, self.fused)  # gemm_rows may start while the norm runs
        h, residual = add_norm(self.post_attention_layernorm, attn, residual, self.fused, trigger)
        return self.mlp(h), residual

    def _forward_row(self, x, residual, cos, sin, batch, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """One row through the Triton GEMV (`ModelOptions.triton_gemv`): each residual add and
        LayerNorm happen inside the GEMV that reads their output (QKV, then up_proj + GeGeLU), and
        at a decode step the rotary and the K/V cache write inside the QKV GEMV as well."""
        mlp, ln2 = self.mlp, self.post_attention_layernorm
        out, residual = self.self_attn.forward_row(
            x, residual, self.input_layernorm, cos, sin, batch, kv_cache
        )
        act, residual = gemv_kernel.gemv(out, mlp.up_proj.weight, mlp.up_proj.bias, gegelu_limit=mlp.limit,
                                         norm=(residual, ln2.weight, ln2.bias, ln2.eps))  # fmt: skip
        return linear(mlp.down_proj, act, True), residual


class Phi3SmallModel(nn.Module):
    def __init__(self, config: Phi3SmallConfig, spec: ModelSpec, options: ModelOptions, fk: dict):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **fk)
        self.layers = nn.ModuleList(DecoderLayer(config, layer, options, fk) for layer in spec.layers)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, **fk)


class Phi3SmallForCausalLM(CausalLM):
    """`forward(input_ids, batch, kv_caches)` -> float32 logits for `batch.logits_index` rows."""

    def __init__(self, config: Phi3SmallConfig, options: ModelOptions | None = None, **fields):
        """`options` (or ModelOptions fields as keywords) say where and how to build it."""
        super().__init__()
        options = ModelOptions.of(options, **fields)
        self.config = config
        self.options = options
        self.spec = model_spec(config, options.force_dense)
        self.attn_impl = options.attn_impl
        fk = {"device": options.device, "dtype": options.dtype}
        self.model = Phi3SmallModel(config, self.spec, options, fk)
        self.lm_head = Linear(  # in-major unless built for the Triton GEMV (see Linear)
            config.hidden_size, config.vocab_size, bias=False, in_major=not options.gemv_on, **fk
        )
        self.rotary = Rotary(config, options.device)
        dummies = (
            config.dummy_token_indices
            if config.dummy_token_indices is not None
            else options.dummy_token_indices
        )
        dummies = sorted({i for i in dummies if 0 <= i < config.vocab_size})
        self.register_buffer(
            "dummy_ids", torch.tensor(dummies, dtype=torch.long, device=options.device), persistent=False
        )
        self.fused = options.attn_impl != "reference"
        self.gemv = options.gemv_on  # a plain bool: what the traced forward reads

    def set_force_dense(self, force_dense: bool) -> None:
        """Switch every layer between its own spec and a dense one (same weights)."""
        self.spec = model_spec(self.config, force_dense)
        for block, layer in zip(self.model.layers, self.spec.layers, strict=True):
            block.self_attn.layer = layer

    def set_triton_gemv(self, on: bool, o_proj: bool | None = None) -> None:
        """Switch the batch-1 linear layers between cuBLAS and the Triton GEMV (same weights);
        `o_proj` also switches `ModelOptions.gemv_o_proj` (the output projection alone)."""
        if not isinstance(on, bool) or not isinstance(o_proj, (bool, type(None))):
            raise InputError(f"set_triton_gemv takes bools, got {on!r}, o_proj={o_proj!r}")
        o_proj = self.options.gemv_o_proj if o_proj is None else o_proj
        self.options = replace(self.options, triton_gemv=on, gemv_o_proj=o_proj)
        self.gemv = on
        for block in self.model.layers:
            block.self_attn.gemv = block.mlp.gemv = on
            block.self_attn.gemv_o = o_proj

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: ForwardBatch,
        kv_caches: list[KVCacheLayer] | None = None,
    ) -> torch.Tensor:  # [B, vocab] float32, or [T, vocab] when batch.logits_index is None
        cfg = self.config
        x = self.model.embed_tokens(input_ids) * cfg.mup_embedding_multiplier  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, batch.use_long_rope)  # [T, D]
        residual = None
        # A prefill that writes a cache needs the last layer's output at the sampled rows only:
        # that layer attends, projects and runs its MLP on just them (its K/V are all written).
        prune = (
            not batch.is_decode
            and kv_caches is not None
            and batch.logits_index is not None
            and (batch.sampled_seq_lens is not None or batch.sampled_block_tables is not None)
        )
        if prune:
            check_sampled(batch)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            rows = batch.logits_index if prune and i == last else None
            x, residual = layer(
                x, residual, cos, sin, batch, kv_caches[i] if kv_caches is not None else None, rows
            )
        if batch.logits_index is not None and not prune:
            x, residual = x[batch.logits_index], residual[batch.logits_index]  # [B, hidden]
        final = self.model.final_layernorm
        if gemv_layer(self.lm_head, self.gemv, x):  # final add + LN inside the GEMV
            out, _ = gemv_kernel.gemv(
                x, self.lm_head.weight, None, norm=(residual, final.weight, final.bias, final.eps)
            )
        else:
            x, _ = add_norm(final, x, residual, self.fused)
            out = self.lm_head(x)
        logits = out.float() / cfg.mup_width_multiplier  # [B, vocab]
        if self.dummy_ids.numel():
            logits.index_fill_(-1, self.dummy_ids, torch.finfo(logits.dtype).min)
        return logits
