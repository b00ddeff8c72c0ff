"""One attention block of Phi-3-Small and of the decoder families (`families.blocks`): the fused
QKV projection, rotary embedding and K/V cache write, sparsegen's prefill or paged-decode
attention with the layer's own `LayerSpec`, and the output projection. Activations are
`[T, hidden]` for the T tokens of a batch; a prefill may finish only some rows (`rows=`, the
model's last layer), a decode step reads the paged cache.

The fused QKV weight's rows are Hkv slots of G query heads, then k, then v (head_dim D each):
Phi-3-Small's checkpoint layout, and the one the families' separate q/k/v projections are
loaded into (`families.fused`), so that the fast paths (the batch-1 GEMV, the few-row GEMM with
the rotary and K/V write fused in, the fused rotary kernel) serve every family. A family adds
per-head q/k RMSNorms (`qk_norm`, before the rotary: its decode steps then rotate in the rotary
kernel, not in the GEMM's epilogue) and learned sinks (`sinks`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..errors import InputError
from ..kernels.fused import rotary as rotary_kernel
from ..kernels.launch_target import pdl_allowed
from ..kernels.linear import gemm_rows as rows_kernel
from ..kernels.linear import gemv as gemv_kernel
from ..spec import LayerSpec
from .batch import ForwardBatch
from .config import Phi3SmallConfig
from .kv_scales import KVLayer, cache_scales, calibrate_once, layer_scales
from .kv_write import read_kv, write_kv
from .layers import Linear, fast_kernels, linear, norm_args, rows_gemm
from .options import ModelOptions
from .rope import RopeWrite, Rotary

# (k_cache, v_cache): [num_pages, page_size, Hkv, D] each; an fp8 cache's is a kv_scales.KVLayer
# (k_cache, v_cache, scales)
KVCacheLayer = tuple[torch.Tensor, torch.Tensor] | KVLayer

GEMV_ROPE = True  # the batch-1 QKV GEMV also rotates and writes the cache (Attention.rope_fusable)
DECODE_PDL_MAX_ROWS = 1  # decode steps up to this batch launch paged decode with PDL (_decode_pdl)


def _decode_pdl(q: torch.Tensor) -> bool:
    """Launch the decode step's paged attention with programmatic dependent launch (sm_90+, up to
    DECODE_PDL_MAX_ROWS sequences, unless SPARSEGEN_NO_PDL): it may start while the rotary kernel
    before it runs, which writes q and the new token's K/V but never seq_lens or the block
    tables (what the kernel reads before it waits; `sparsegen.paged_decode`'s `pdl`).
    Measured on the H200 (`benchmarks/engine/ab_decode_step.py`, alternating engines, 8K context): batch 1
    5.019 / 5.011 -> 4.957 / 4.956 ms per step, but batch 32 11.05 -> 11.49 / 11.51 ms, hence
    the row limit (2 to 31 not measured)."""
    return q.is_cuda and pdl_allowed(q.device, q.shape[0], DECODE_PDL_MAX_ROWS)


class Attention(nn.Module):
    """`names`: the fused QKV and output projections' module names (Phi-3-Small's by default)."""

    def __init__(self, config: Phi3SmallConfig, layer: LayerSpec, options: ModelOptions, fk: dict,
                 qkv_bias: bool = True, out_bias: bool = True,
                 names: tuple[str, str] = ("query_key_value", "dense")):  # fmt: skip
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
        self.names = names
        self.add_module(names[0], Linear(config.hidden_size, qkv_out, bias=qkv_bias, **fk))
        self.add_module(
            names[1], Linear(self.num_heads * self.head_dim, config.hidden_size, bias=out_bias, **fk)
        )
        self.qk_norm = False  # per-head q / k norms (`q_norm`, `k_norm`: a family sets them)
        self.sinks = None  # [H]: a learned sink logit per head (a family's parameter)

    @property
    def qkv_linear(self) -> nn.Module:
        return self._modules[self.names[0]]

    @property
    def out_linear(self) -> nn.Module:
        return self._modules[self.names[1]]

    def _sinks(self) -> torch.Tensor | None:
        return self.sinks.float() if self.layer.learned_sinks else None  # [H] float32

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
        [B, max_pages] int32, lens: [B] int32) -> [B, H, D]. An fp8 cache's scales go with it."""
        ks, vs = cache_scales(kv_cache)  # [Hkv] float32 each, or None
        sinks = self._sinks()
        if torch.compiler.is_compiling():
            return torch.ops.sparsegen.paged_decode(q, kv_cache[0], kv_cache[1], tables, lens, self.layer_json,
                                                    self.scale, self.decode_impl, None, sinks, ks, vs)  # fmt: skip
        return ops.paged_decode(q, kv_cache[0], kv_cache[1], tables, lens, self.layer, scale=self.scale,
                                impl=self.decode_impl, pdl=_decode_pdl(q), sinks=sinks, k_scale=ks,
                                v_scale=vs)  # fmt: skip

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D]. check=False: the engine built cu_seqlens
        itself (no host read, no sync); max_seqlen_* are known on the host, so the kernel's grid
        needs no sync either."""
        sinks = self._sinks()
        if torch.compiler.is_compiling():
            return torch.ops.sparsegen.prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, self.layer_json,
                                               self.scale, self.prefill_impl, False, batch.max_seqlen_q,
                                               batch.max_seqlen_k, sinks)  # fmt: skip
        return ops.prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, self.layer, scale=self.scale,
                           impl=self.prefill_impl, check=False, max_seqlen_q=batch.max_seqlen_q,
                           max_seqlen_k=batch.max_seqlen_k, sinks=sinks)  # fmt: skip

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
        qkv_linear = self.qkv_linear
        if rows_gemm(qkv_linear, x, self.fused) and self.rope_fusable(batch, kv_cache):
            # 2..32 decode tokens: one kernel for QKV, the rotary and the K/V cache write (gemm_rows)
            rope = RopeWrite(cos, sin, self.group, kv_cache[0], kv_cache[1], batch.slot_mapping)
            q = rows_kernel.gemm_rows(x, qkv_linear.weight, qkv_linear.bias, rope=rope)  # [T, H * D]
            return self.decode_rotated(q, batch, kv_cache)
        qkv = linear(qkv_linear, x, self.gemv, self.fused)  # [T, (H + 2 Hkv) * D]
        return self.attend(qkv, cos, sin, batch, kv_cache, rows)

    def forward_row(self, x, residual, norm: nn.Module, cos, sin, batch: ForwardBatch,
                    kv_cache: KVCacheLayer | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One row (x, residual: [1, hidden]) through the Triton GEMV: `norm(x + residual)` inside
        the QKV GEMV, and at a decode step the rotary and the K/V cache write as well ->
        (the attention block's output [1, hidden], x + residual)."""
        w, b = self.qkv_linear.weight, self.qkv_linear.bias
        args, kind = norm_args(norm, residual)
        if self.rope_fusable(batch, kv_cache):  # rotary and the K/V write inside the QKV GEMV too
            rope = RopeWrite(cos, sin, self.group, kv_cache[0], kv_cache[1], batch.slot_mapping)
            q, residual = gemv_kernel.gemv(x, w, b, norm=args, norm_kind=kind, rope=rope)  # [1, H * D]
            return self.decode_rotated(q, batch, kv_cache), residual
        qkv, residual = gemv_kernel.gemv(x, w, b, norm=args, norm_kind=kind)
        return self.attend(qkv, cos, sin, batch, kv_cache), residual

    def norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv: [T, Hkv, G + 2, D] with each query and key head RMS-normed (`q_norm`, `k_norm`)."""
        g = self.group
        q, k = self.q_norm(qkv[:, :, :g]), self.k_norm(qkv[:, :, g : g + 1])
        return torch.cat((q, k, qkv[:, :, g + 1 :]), dim=2)

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
        if self.qk_norm:
            qkv = self.norm_qk(qkv)
        write = kv_cache if kv_cache is not None and batch.slot_mapping is not None else None
        if rows is not None and (write is None or batch.sampled_block_tables is None):
            raise InputError("attention from the sampled rows only needs a KV cache written by this batch "
                             "and batch.sampled_block_tables / sampled_seq_lens")  # fmt: skip
        scales = layer_scales(write)  # an fp8 cache's (quantised by the fused kernel or the torch path)
        # An fp8 cache whose scales the first prefill still has to calibrate takes the torch path
        # (calibrate_once, then write_kv); decode steps never calibrate, so they always take the
        # fused kernel, which reads the scales on the device (a captured graph included).
        fused_write = scales is None or scales.ready or batch.is_decode
        if (
            self.fused and fused_write and fast_kernels(qkv) and rotary_kernel.supports_rotary(qkv)
        ):  # one kernel: rotary, split, cache write (fp8: quantised with the layer's scales)
            q, k, v = rotary_kernel.rotary_qkv(qkv, cos, sin, write, batch.slot_mapping, scales)
        else:
            q = Rotary.apply(qkv[:, :, :g].reshape(t, h, d), cos, sin)  # [T, H, D]
            k = Rotary.apply(qkv[:, :, g], cos, sin)  # [T, Hkv, D]
            v = qkv[:, :, g + 1].contiguous()  # [T, Hkv, D]
            if write is not None:
                calibrate_once(scales, k, v, batch)
                write_kv(write[0], write[1], batch.slot_mapping, k, v, scales)
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
                # [Tk, Hkv, D]: cached prefix + new (fp8: dequantised to q's dtype in the gather)
                ks, vs = cache_scales(kv_cache)
                k_all = read_kv(kv_cache[0], batch.kv_gather, ks, q.dtype)
                v_all = read_kv(kv_cache[1], batch.kv_gather, vs, q.dtype)
            else:
                k_all, v_all = k, v
            out = self._prefill(q, k_all, v_all, batch)
        return self._project(out)

    def rope_fusable(self, batch: ForwardBatch, kv_cache: KVCacheLayer | None) -> bool:
        """A decode step whose QKV GEMV can also rotate q and k and write k and v into the cache
        (`rope.RopeWrite`): fused kernels on, a bf16/fp16 cache to write (its epilogue does not
        write fp8), a power-of-two head_dim, no q/k norms between the projection and the rotary."""
        d = self.head_dim
        return (
            GEMV_ROPE
            and self.fused
            and not self.qk_norm
            and batch.is_decode
            and kv_cache is not None
            and batch.slot_mapping is not None
            and cache_scales(kv_cache)[0] is None
            and not d & (d - 1)
        )

    def decode_rotated(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: KVCacheLayer) -> torch.Tensor:
        """q: [T, H * D] already rotated, with k and v already in the cache -> [T, hidden]."""
        q = q.view(q.shape[0], self.num_heads, self.head_dim)  # [T, H, D]
        return self._project(self._decode(q, kv_cache, batch.block_tables, batch.seq_lens))

    def _project(self, out: torch.Tensor) -> torch.Tensor:  # out: [T, H, D] -> [T, hidden]
        t = out.shape[0]
        return linear(
            self.out_linear, out.reshape(t, -1), self.gemv or (self.gemv_o and out.is_cuda), self.fused
        )
