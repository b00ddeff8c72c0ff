"""The shared layers of the decoder families: RMSNorm (and Gemma's 1 + w, `models.layers`), the
SwiGLU / GeGLU-tanh MLP (or gpt-oss's experts, `moe`), and attention (`models.attention`, the
module Phi-3-Small's attention is) with a fused QKV projection (optional biases), per-head q/k
RMSNorms and learned sinks, over the engine's paged KV cache with each layer's own `LayerSpec`.

The fast paths are Phi-3-Small's, chosen by the same policy (`models.layers`): q/k/v and gate/up
are fused at load (`fused`), so a batch-1 step runs the Triton GEMV with the residual add +
RMSNorm inside QKV's and gate_up's, the rotary and K/V cache write inside QKV's (not with q/k
norms: Qwen3, Gemma-3), SwiGLU / GeGLU inside gate_up's; 2..32 rows run `gemm_rows` for the
weight shapes `ROWS_LAYERS` lists (QKV with the rotary epilogue at a decode step); every
residual add + norm is one kernel (`add_norm`, RMS kinds), and the rotary with the K/V write is
the fused rotary kernel wherever the GEMM epilogue does not do it. Every rotary variant
(default, linear, llama3, yarn, Gemma-3's two bases) is a cos/sin table, so each takes them all.
On a CPU (and for attn_impl="reference") every op is plain torch. Activations are `[T, features]`
for T tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.linear import gemv as gemv_kernel
from ...spec import LayerSpec
from ..attention import Attention, KVCacheLayer
from ..batch import ForwardBatch
from ..layers import Linear, RMSNorm, add_norm, fusable_norm, gemv_row, linear, norm_args, rows_gemm
from ..options import ModelOptions
from .config import DecoderConfig
from .moe import MixtureOfExperts

__all__ = ["DecoderAttention", "DecoderLayer", "GatedMLP", "KVCacheLayer", "RMSNorm"]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU with tanh-approximated GELU, gate and up
    one interleaved weight (`fused.gate_up_rows`)."""

    def __init__(self, config: DecoderConfig, options: ModelOptions, fk: dict):
        super().__init__()
        h, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.act = config.act  # a key of kernels.linear.gemv.GLU_ACTS
        self.fused = options.attn_impl != "reference"
        self.gemv = options.gemv_on
        self.gate_up_proj = Linear(h, 2 * f, bias=b, **fk)  # rows: gate 0, up 0, gate 1, ...
        self.down_proj = Linear(f, h, bias=b, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate_up = linear(self.gate_up_proj, x, self.gemv, self.fused)  # [T, 2F]
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]  # [T, F] each
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return linear(self.down_proj, act * up, self.gemv, self.fused)

    def forward_row(self, x, residual, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """One row: norm(x + residual), gate_up and the activation in one GEMV, then down_proj ->
        (the MLP's output [1, hidden], x + residual)."""
        args, kind = norm_args(norm, residual)
        w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
        act, residual = gemv_kernel.gemv(x, w, b, glu=self.act, norm=args, norm_kind=kind)  # [1, F]
        return linear(self.down_proj, act, True), residual


class DecoderAttention(Attention):
    """`models.attention.Attention` with the family's biases, q/k norms and sinks; the fused
    projection is `qkv_proj`, the output one `o_proj`."""

    def __init__(self, config: DecoderConfig, layer: LayerSpec, options: ModelOptions, fk: dict):
        super().__init__(config, layer, options, fk, qkv_bias=config.qkv_bias, out_bias=config.o_bias,
                         names=("qkv_proj", "o_proj"))  # fmt: skip
        d = config.head_dim
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, fk, config.norm_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, fk, config.norm_offset)
            self.qk_norm = True
        if config.sinks:
            self.sinks = nn.Parameter(torch.empty(config.num_attention_heads, **fk))  # [H] sink logits


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). With `sandwich` (Gemma-2/3) the
    attention output is normed before its add (`post_attention_layernorm`) and the MLP is
    wrapped in `pre_feedforward_layernorm` / `post_feedforward_layernorm`. Like Phi-3-Small's
    block it takes and returns the residual stream apart from the block's output, so that each
    residual add is done together with the norm after it (`add_norm`)."""

    def __init__(self, config: DecoderConfig, layer: LayerSpec, options: ModelOptions, fk: dict):
        super().__init__()
        eps, h, off = config.rms_norm_eps, config.hidden_size, config.norm_offset
        self.sandwich = config.sandwich
        self.fused = options.attn_impl != "reference"
        self.input_layernorm = RMSNorm(h, eps, fk, off)
        self.self_attn = DecoderAttention(config, layer, options, fk)
        self.post_attention_layernorm = RMSNorm(h, eps, fk, off)
        if config.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, fk, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, fk, off)
        self.mlp = MixtureOfExperts(config, fk) if config.num_experts else GatedMLP(config, options, fk)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm before the MLP, which the residual add goes with."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def _post(self, norm_name: str, out: torch.Tensor) -> torch.Tensor:
        """A sandwich norm of a sub-block's output (no residual), or the output itself."""
        return add_norm(getattr(self, norm_name), out, None, self.fused)[0] if self.sandwich else out

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous block's output (the embeddings for block 0)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before x is added; None for block 0
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        batch: ForwardBatch,
        kv_cache: KVCacheLayer | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this block's output, the stream before it)
        attn = self.self_attn
        if gemv_row(attn.gemv, x) and fusable_norm(self.input_layernorm):
            return self._forward_row(x, residual, cos, sin, batch, kv_cache)
        trigger = rows_gemm(attn.qkv_proj, x, self.fused)  # gemm_rows may start while the norm runs
        h, residual = add_norm(self.input_layernorm, x, residual, self.fused, trigger)
        out = self._post("post_attention_layernorm", attn(h, cos, sin, batch, kv_cache))
        trigger = isinstance(self.mlp, GatedMLP) and rows_gemm(self.mlp.gate_up_proj, out, self.fused)
        h, residual = add_norm(self.mlp_norm, out, residual, self.fused, trigger)
        return self._post("post_feedforward_layernorm", self.mlp(h)), residual

    def _forward_row(self, x, residual, cos, sin, batch, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """One row through the Triton GEMV (`ModelOptions.triton_gemv`): the residual add + norm
        inside the QKV GEMV (with the rotary and K/V write at a decode step) and inside the
        gate_up GEMV (with the activation)."""
        out, residual = self.self_attn.forward_row(
            x, residual, self.input_layernorm, cos, sin, batch, kv_cache
        )
        out = self._post("post_attention_layernorm", out)
        if isinstance(self.mlp, GatedMLP):
            out, residual = self.mlp.forward_row(out, residual, self.mlp_norm)
        else:  # gpt-oss's experts: the add + norm kernel, then the expert loop
            h, residual = add_norm(self.mlp_norm, out, residual, self.fused)
            out = self.mlp(h)
        return self._post("post_feedforward_layernorm", out), residual
