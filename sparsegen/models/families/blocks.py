"""The shared layers of the decoder families: RMSNorm (and Gemma's 1 + w), the SwiGLU / GeGLU-tanh
MLPs (or gpt-oss's experts, `moe`), and attention
with separate q/k/v/o projections (optional biases, per-head q/k RMSNorm, learned sinks) whose
attention goes through `sparsegen.prefill` / `sparsegen.paged_decode` with the layer's own
`LayerSpec`, over the engine's paged KV cache. Module names equal the HF tensor names. Plain
torch math (cuBLAS linears; the batch-1 Triton GEMV for the projections when the options turn it
on). Activations are `[T, features]` for T tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...errors import InputError
from ...spec import LayerSpec
from ..batch import ForwardBatch
from ..kv_scales import calibrate_once, layer_scales
from ..kv_write import read_kv, write_kv
from ..layers import Linear, linear
from ..options import ModelOptions
from ..rope import Rotary
from .config import DecoderConfig
from .moe import MixtureOfExperts

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [num_pages, page_size, Hkv, D]


class RMSNorm(nn.Module):
    """x / rms(x) * w in float32, cast back before the weight, as transformers' Llama does; with
    `offset` (Gemma's 1), x / rms(x) * (offset + w) all in float32, then cast, as Gemma does."""

    def __init__(self, size: int, eps: float, fk: dict, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.empty(size, **fk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., size]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU with tanh-approximated GELU."""

    def __init__(self, config: DecoderConfig, options: ModelOptions, fk: dict):
        super().__init__()
        h, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.act = config.act
        self.gemv = options.triton_gemv is True  # the GEMV only when asked (see model.py)
        self.gate_proj = Linear(h, f, bias=b, **fk)
        self.up_proj = Linear(h, f, bias=b, **fk)
        self.down_proj = Linear(f, h, bias=b, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate, up = linear(self.gate_proj, x, self.gemv), linear(self.up_proj, x, self.gemv)  # [T, F]
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return linear(self.down_proj, act * up, self.gemv)


class DecoderAttention(nn.Module):
    def __init__(self, config: DecoderConfig, layer: LayerSpec, options: ModelOptions, fk: dict):
        super().__init__()
        self.layer = layer
        self.prefill_impl, self.decode_impl = options.attn_impls
        self.gemv = options.triton_gemv is True  # the GEMV only when asked (see model.py)
        h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.scale = config.attention_scale
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = Linear(hidden, h * d, bias=bias, **fk)
        self.k_proj = Linear(hidden, hkv * d, bias=bias, **fk)
        self.v_proj = Linear(hidden, hkv * d, bias=bias, **fk)
        self.o_proj = Linear(h * d, hidden, bias=config.o_bias, **fk)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, fk, config.norm_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, fk, config.norm_offset)
        self.qk_norm = config.qk_norm
        if config.sinks:
            self.sinks = nn.Parameter(torch.empty(h, **fk))  # [H]: one sink logit per head

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        batch: ForwardBatch,
        kv_cache: KVCacheLayer | None,
    ) -> torch.Tensor:  # [T, hidden]
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = linear(self.q_proj, x, self.gemv).view(t, h, d)  # [T, H, D]
        k = linear(self.k_proj, x, self.gemv).view(t, hkv, d)  # [T, Hkv, D]
        v = linear(self.v_proj, x, self.gemv).view(t, hkv, d).contiguous()  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        scales = layer_scales(kv_cache)  # an fp8 cache's (None for bf16/fp16)
        ks, vs = (scales.k, scales.v) if scales is not None else (None, None)  # [Hkv] float32 each
        if kv_cache is not None and batch.slot_mapping is not None:
            calibrate_once(scales, k, v, batch)
            write_kv(kv_cache[0], kv_cache[1], batch.slot_mapping, k, v, scales)
        sinks = self.sinks.float() if self.layer.learned_sinks else None  # [H] float32
        if batch.is_decode:
            if kv_cache is None:
                raise InputError("a decode step needs a KV cache")
            out = ops.paged_decode(q, kv_cache[0], kv_cache[1], batch.block_tables, batch.seq_lens, self.layer,
                                   scale=self.scale, impl=self.decode_impl, sinks=sinks, k_scale=ks,
                                   v_scale=vs)  # fmt: skip
        else:
            if batch.kv_gather is not None:
                k = read_kv(kv_cache[0], batch.kv_gather, ks, q.dtype)  # [Tk, Hkv, D]: cached prefix + new
                v = read_kv(kv_cache[1], batch.kv_gather, vs, q.dtype)  # (fp8: dequantised in the gather)
            out = ops.prefill(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, self.layer, scale=self.scale,
                              impl=self.prefill_impl, check=False, max_seqlen_q=batch.max_seqlen_q,
                              max_seqlen_k=batch.max_seqlen_k, sinks=sinks)  # fmt: skip
        return linear(self.o_proj, out.reshape(t, h * d), self.gemv)  # [T, hidden]


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). With `sandwich` (Gemma-2/3) the
    attention output is normed before its add (`post_attention_layernorm`) and the MLP is
    wrapped in `pre_feedforward_layernorm` / `post_feedforward_layernorm`."""

    def __init__(self, config: DecoderConfig, layer: LayerSpec, options: ModelOptions, fk: dict):
        super().__init__()
        eps, h, off = config.rms_norm_eps, config.hidden_size, config.norm_offset
        self.sandwich = config.sandwich
        self.input_layernorm = RMSNorm(h, eps, fk, off)
        self.self_attn = DecoderAttention(config, layer, options, fk)
        self.post_attention_layernorm = RMSNorm(h, eps, fk, off)
        if config.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, fk, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, fk, off)
        self.mlp = MixtureOfExperts(config, fk) if config.num_experts else GatedMLP(config, options, fk)

    def forward(self, x, cos, sin, batch: ForwardBatch, kv_cache: KVCacheLayer | None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache)  # [T, hidden]
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
