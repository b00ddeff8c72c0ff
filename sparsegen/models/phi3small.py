"""Phi-3-Small (DESIGN §2) as a plain PyTorch module whose attention is sparsegen's.

Module names equal the checkpoint's tensor names (`model.layers.N.self_attn.query_key_value`,
...), so `state_dict()` *is* the HF layout. Attention goes only through `sparsegen.prefill` /
`sparsegen.paged_decode`, each layer with its own `LayerSpec`: compiled kernels on a GPU, the
reference on a CPU. Tokens are flattened: activations are `[T, hidden]` for T tokens of a batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .. import ops
from ..errors import InputError
from ..presets import from_hf_config
from ..spec import HeadSpec, LayerSpec, ModelSpec
from .batch import ForwardBatch
from .config import Phi3SmallConfig
from .kv_write import read_kv, write_kv
from .layers import (
    Embedding,
    Linear,
    add_norm,
    fast_kernels,
    fused_ops,
    gegelu,
    gemv_layer,
    gemv_row,
    linear,
    rows_gemm,
)  # fmt: skip
from .options import ATTN_IMPLS, ModelOptions
from .rope import RopeWrite, Rotary

__all__ = ["ATTN_IMPLS", "KVCacheLayer", "Phi3SmallForCausalLM", "gegelu", "model_spec"]

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [num_pages, page_size, Hkv, D]


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


GEMV_ROPE = True  # the batch-1 QKV GEMV also rotates and writes the cache (Attention.rope_fusable)
DECODE_PDL_MAX_ROWS = 1  # decode steps up to this batch launch paged decode with PDL (_decode_pdl)


def _decode_pdl(q: torch.Tensor) -> bool:
    """Launch the decode step's paged attention with programmatic dependent launch (sm_90+, up to
    DECODE_PDL_MAX_ROWS sequences, unless SPARSEGEN_NO_PDL): it may start while the rotary kernel
    before it runs, which writes q and the new token's K/V but never seq_lens or the block
    tables (what the kernel reads before it waits; `sparsegen.paged_decode`'s `pdl`).
    H200, session 7 (`benchmarks/ab_decode_step.py`, alternating engines, 8K context): batch 1
    5.019 / 5.011 -> 4.957 / 4.956 ms per step, but batch 32 11.05 -> 11.49 / 11.51 ms, hence
    the row limit (2 to 31 not measured)."""
    return q.is_cuda and fused_ops().pdl_allowed(q.device, q.shape[0], DECODE_PDL_MAX_ROWS)


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


class Attention(nn.Module):
    def __init__(self, config: Phi3SmallConfig, layer: LayerSpec, options: ModelOptions, fk: dict):
        super().__init__()
        self.layer = layer  # also sets layer_json
        self.prefill_impl, self.decode_impl = options.attn_impls  # for sparsegen.prefill / paged_decode
        self.fused = options.attn_impl != "reference"  # the fused rotary kernel, on a GPU
        self.gemv = options.gemv_on
        self.gemv_o = options.gemv_o_proj  # the output projection alone through the GEMV, on a GPU
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.group = config.group_size
        self.scale = config.attention_scale
        self.hidden = config.hidden_size
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = Linear(config.hidden_size, qkv_out, bias=True, **fk)
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True, **fk)

    @property
    def layer(self) -> LayerSpec:
        return self._layer

    @layer.setter
    def layer(self, layer: LayerSpec) -> None:
        self._layer = layer
        # What the registered ops take when traced: a str constant. torch 2.11's dynamo cannot
        # reconstruct a frozen dataclass (the LayerSpec) that crosses into a call it does not inline.
        self.layer_json = layer.to_json()

    def _decode(
        self, q: torch.Tensor, kv_cache: KVCacheLayer, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """q: [B, H, D], the last token of each of B sequences, over the paged cache (tables:
        [B, max_pages] int32, lens: [B] int32) -> [B, H, D]."""
        if torch.compiler.is_compiling():
            return torch.ops.sparsegen.paged_decode(q, kv_cache[0], kv_cache[1], tables, lens, self.layer_json,
                                                    self.scale, self.decode_impl, None)  # fmt: skip
        return ops.paged_decode(q, kv_cache[0], kv_cache[1], tables, lens, self.layer, scale=self.scale,
                                impl=self.decode_impl, pdl=_decode_pdl(q))  # fmt: skip

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D]. check=False: the engine built cu_seqlens
        itself (no host read, no sync); max_seqlen_* are known on the host, so the kernel's grid
        needs no sync either."""
        if torch.compiler.is_compiling():
            return torch.ops.sparsegen.prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, self.layer_json,
                                               self.scale, self.prefill_impl, False, batch.max_seqlen_q,
                                               batch.max_seqlen_k)  # fmt: skip
        return ops.prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, self.layer, scale=self.scale,
                           impl=self.prefill_impl, check=False, max_seqlen_q=batch.max_seqlen_q,
                           max_seqlen_k=batch.max_seqlen_k)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        batch: ForwardBatch,
        kv_cache: KVCacheLayer | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden], or [len(rows), hidden]
        """`rows` ([R] int64, a prefill's logits_index, with batch.sampled_*): QKV, the rotary
        and the cache write for every token, attention and the output projection for these
        rows only (each the last token of its sequence, so a decode over the cache just written)."""
        if rows_gemm(self.query_key_value, x, self.fused) and self.rope_fusable(batch, kv_cache):
            # 2..32 decode tokens: one kernel for QKV, the rotary and the K/V cache write (gemm_rows)
            from .gemm_rows import gemm_rows

            rope = RopeWrite(cos, sin, self.group, kv_cache[0], kv_cache[1], batch.slot_mapping)
            q = gemm_rows(x, self.query_key_value.weight, self.query_key_value.bias, rope=rope)  # [T, H * D]
            return self.decode_rotated(q, batch, kv_cache)
        qkv = linear(self.query_key_value, x, self.gemv, self.fused)  # [T, (H + 2 Hkv) * D]
        return self.attend(qkv, cos, sin, batch, kv_cache, rows)

    def attend(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]: the query_key_value projection
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        batch: ForwardBatch,
        kv_cache: KVCacheLayer | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden], or [len(rows), hidden]
        """Everything of the block's attention after the QKV projection: rotary, the cache write,
        attention, the output projection (`rows`: see forward)."""
        t = qkv.shape[0]
        h, hkv, d, g = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        qkv = qkv.view(t, hkv, g + 2, d)  # per KV group: G queries, then k, then v
        write = kv_cache if kv_cache is not None and batch.slot_mapping is not None else None
        if rows is not None and (write is None or batch.sampled_block_tables is None):
            raise InputError("attention from the sampled rows only needs a KV cache written by this batch "
                             "and batch.sampled_block_tables / sampled_seq_lens")  # fmt: skip
        if (
            self.fused and fast_kernels(qkv) and fused_ops().supports_rotary(qkv)
        ):  # one kernel: rotary, split, cache write
            q, k, v = fused_ops().rotary_qkv(qkv, cos, sin, write, batch.slot_mapping)
        else:
            q = Rotary.apply(qkv[:, :, :g].reshape(t, h, d), cos, sin)  # [T, H, D]
            k = Rotary.apply(qkv[:, :, g], cos, sin)  # [T, Hkv, D]
            v = qkv[:, :, g + 1].contiguous()  # [T, Hkv, D]
            if write is not None:
                write_kv(write[0], write[1], batch.slot_mapping, k, v)
        if rows is not None:
            if rows.shape[0] == 0:  # nothing sampled (a long prompt's earlier chunk): K/V only
                return qkv.new_empty((0, self.hidden))
            out = self._decode(q[rows], kv_cache, batch.sampled_block_tables, batch.sampled_seq_lens)
        elif batch.is_decode:
            if kv_cache is None:
                raise InputError("a decode step needs a KV cache")
            out = self._decode(q, kv_cache, batch.block_tables, batch.seq_lens)
        else:
            if batch.kv_gather is not None:
                k_all = read_kv(kv_cache[0], batch.kv_gather)  # [Tk, Hkv, D]: cached prefix + new
                v_all = read_kv(kv_cache[1], batch.kv_gather)
            else:
                k_all, v_all = k, v
            out = self._prefill(q, k_all, v_all, batch)
        return self._project(out)

    def rope_fusable(self, batch: ForwardBatch, kv_cache: KVCacheLayer | None) -> bool:
        """A decode step whose QKV GEMV can also rotate q and k and write k and v into the cache
        (`rope.RopeWrite`): fused kernels on, a cache to write, a power-of-two head_dim."""
        d = self.head_dim
        return (
            GEMV_ROPE
            and self.fused
            and batch.is_decode
            and kv_cache is not None
            and batch.slot_mapping is not None
            and not d & (d - 1)
        )

    def decode_rotated(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: KVCacheLayer) -> torch.Tensor:
        """q: [T, H * D] already rotated, with k and v already in the cache -> [T, hidden]."""
        q = q.view(q.shape[0], self.num_heads, self.head_dim)  # [T, H, D]
        return self._project(self._decode(q, kv_cache, batch.block_tables, batch.seq_lens))

    def _project(self, out: torch.Tensor) -> torch.Tensor:  # out: [T, H, D] -> [T, hidden]
        t = out.shape[0]
        return linear(self.dense, out.reshape(t, -1), self.gemv or (self.gemv_o and out.is_cuda), self.fused)


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
            from .gemv import gemv as triton_gemv

            act = triton_gemv(x, self.up_proj.weight, self.up_proj.bias, gegelu_limit=self.limit)  # [1, F]
            return linear(self.down_proj, act, True)
        if rows_gemm(self.up_proj, x, self.fused):  # 2..32 rows: one kernel, up_proj and GeGeLU
            from .gemm_rows import gemm_rows

            act = gemm_rows(x, self.up_proj.weight, self.up_proj.bias, gegelu_limit=self.limit)  # [T, F]
            return linear(self.down_proj, act, False, self.fused)
        up = self.up_proj(x)  # [T, 2 * F], gate and linear columns interleaved
        if self.fused and fast_kernels(x):
            act = fused_ops().gegelu(up, self.limit)  # [T, F]
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
        from .gemv import gemv

        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        w, b, norm = (
            attn.query_key_value.weight,
            attn.query_key_value.bias,
            (residual, ln1.weight, ln1.bias, ln1.eps),
        )
        if attn.rope_fusable(batch, kv_cache):  # rotary and the K/V write inside the QKV GEMV too
            rope = RopeWrite(cos, sin, attn.group, kv_cache[0], kv_cache[1], batch.slot_mapping)
            q, residual = gemv(x, w, b, norm=norm, rope=rope)  # [1, H * D]
            out = attn.decode_rotated(q, batch, kv_cache)  # [1, hidden]
        else:
            qkv, residual = gemv(x, w, b, norm=norm)
            out = attn.attend(qkv, cos, sin, batch, kv_cache)  # [1, hidden]
        act, residual = gemv(out, mlp.up_proj.weight, mlp.up_proj.bias, gegelu_limit=mlp.limit,
                             norm=(residual, ln2.weight, ln2.bias, ln2.eps))  # fmt: skip
        return linear(mlp.down_proj, act, True), residual


class Phi3SmallModel(nn.Module):
    def __init__(self, config: Phi3SmallConfig, spec: ModelSpec, options: ModelOptions, fk: dict):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **fk)
        self.layers = nn.ModuleList(DecoderLayer(config, layer, options, fk) for layer in spec.layers)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, **fk)


class Phi3SmallForCausalLM(nn.Module):
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

    def tie_embeddings(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def local_num_kv_heads(self) -> int:
        """KV heads whose cache this process holds: all of them here; a rank's own groups under
        tensor parallelism (`models.tensor_parallel`). The engine sizes its KV cache by this."""
        return self.config.num_key_value_heads

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

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
            from .gemv import gemv

            out, _ = gemv(x, self.lm_head.weight, None, norm=(residual, final.weight, final.bias, final.eps))
        else:
            x, _ = add_norm(final, x, residual, self.fused)
            out = self.lm_head(x)
        logits = out.float() / cfg.mup_width_multiplier  # [B, vocab]
        if self.dummy_ids.numel():
            logits.index_fill_(-1, self.dummy_ids, torch.finfo(logits.dtype).min)
        return logits
