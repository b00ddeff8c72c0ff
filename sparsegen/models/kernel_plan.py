"""The compiled kernels a model launches besides attention, as lifecycle requests, so that
`sparsegen compile --model-kernels` builds them ahead of time (no GPU needed): Phi-3-Small's
(`phi3_kernel_requests`) and a decoder family's (`decoder_kernel_requests`, the same fast paths
with RMSNorms and SwiGLU / GeGLU: `families.blocks`); `model_kernel_requests` picks by config.

The list follows the model's policy for an engine on an sm_90 GPU with the fused kernels and
the batch-1 GEMV on (the defaults there):
- a batch-1 decode step: the GEMV for QKV (residual add + LayerNorm, rotary and K/V write
  inside; block 0 has no residual yet), up_proj (+ add + LayerNorm, GeGeLU), down_proj, the
  output projection, lm_head (+ the final add + LayerNorm);
- steps of 2..32 rows (decode batches, short prefill chunks): `gemm_rows` for `ROWS_LAYERS`
  (QKV with the rotary epilogue at decode steps, plainly in a prefill; up_proj with GeGeLU;
  the output projection), add + LayerNorm launched with PDL and triggering the GEMM after it,
  the rotary kernel for a prefill's QKV;
- longer prefills: add + LayerNorm, the rotary kernel (one token per program, and the tiled
  one from `ROTARY_TILED_FROM` tokens on), GeGeLU; the last block's sampled rows (one: the
  GEMV without a norm before up_proj) and the final add + LayerNorm over them.
Each request is made by the kernel's own launch planning (`request(...)` of each kernel
module) from meta tensors of the model's shapes, so it is the request the launch will make.
A launch this list misses is built on first use, as any kernel is (unless SPARSEGEN_DISABLE_JIT).
"""

from __future__ import annotations

import torch

from .. import dtypes
from ..env import parse_arch
from ..kernels.base import KernelRequest
from ..kernels.fused import add_norm, gegelu, rotary
from ..kernels.launch_target import aot_target
from ..kernels.linear import gemm_rows, gemv
from ..kernels.linear.rope_write import RopeWrite
from .config import Phi3SmallConfig
from .families.config import DecoderConfig
from .kv_scales import KVScales
from .layers import ROWS_LAYERS

ROW_COUNTS = (2, 32)  # rows of a few-row step: gemm_rows' and add + LayerNorm's PDL range
PREFILL_TOKENS = (64, rotary.ROTARY_TILED_FROM)  # a short and a long prefill chunk


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def model_kernel_requests(
    config: Phi3SmallConfig | DecoderConfig,
    dtype: torch.dtype,
    arch: str,
    page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> list[KernelRequest]:
    """The model kernels of `config` (either kind) in `dtype` on a GPU of `arch`; with `kv_dtype`
    (an fp8 dtype) also the rotary kernels that write an fp8 cache."""
    if isinstance(config, DecoderConfig):
        return decoder_kernel_requests(config, dtype, arch, page_size, kv_dtype)
    return phi3_kernel_requests(config, dtype, arch, page_size, kv_dtype)


def _cache(hkv: int, d: int, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    return _meta(4, hkv, page_size, d, dtype=dtype).transpose(1, 2)  # [pages, page_size, Hkv, D], head-major


def _fp8_cache(hkv: int, d: int, page_size: int, kv_dtype: torch.dtype):
    """An fp8 cache (head-major pages) and its per-head scales, as meta tensors."""
    return _cache(hkv, d, page_size, kv_dtype), KVScales(hkv, kv_dtype, "meta")  # scales: [Hkv] float32


def _rotary_requests(hkv, g, d, cache, target, arch, dtype, scales=None) -> list:
    """The fused rotary + K/V write at each token count the model launches it for, from a `dtype`
    qkv into `cache` (an fp8 one with its `scales`)."""
    extra = {} if scales is None else {"scales": scales}
    out = []
    for t in (1, *ROW_COUNTS, *PREFILL_TOKENS):
        qkv = _meta(t, hkv, g + 2, d, dtype=dtype)
        cos = _meta(t, d, dtype=torch.float32)
        out.append(rotary.request(qkv, cos, cos, (cache, cache), _meta(t, dtype=torch.int64), target=target,
                                  arch=arch, **extra))  # fmt: skip
    return out


def phi3_kernel_requests(
    config: Phi3SmallConfig,
    dtype: torch.dtype,
    arch: str,
    page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> list[KernelRequest]:
    """The model kernels (kinds gemv, gemm_rows, rotary_kv_write, gegelu, add_norm) for `config`
    in `dtype` on a GPU of `arch`, with a KV cache of `page_size`-token head-major pages; each
    request once, in a stable order. An fp8 `kv_dtype` adds the rotary kernel's fp8-writing
    variants (an fp8 cache's decode steps and prefills once its scales are set)."""
    target = aot_target(arch)
    hidden, ff, vocab = config.hidden_size, config.ff_intermediate_size, config.vocab_size
    h, hkv, d, g = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.group_size
    qkv_rows = (h + 2 * hkv) * d
    m = lambda *shape: _meta(*shape, dtype=dtype)  # noqa: E731 - a short name for many shapes
    ln_w, ln_b, eps = m(hidden), m(hidden), config.layer_norm_epsilon
    w_qkv, b_qkv, w_o, b_o = m(qkv_rows, hidden), m(qkv_rows), m(hidden, h * d), m(hidden)
    w_up, b_up, w_down, b_down = m(2 * ff, hidden), m(2 * ff), m(hidden, ff), m(hidden)
    w_lm = m(vocab, hidden)
    cache = _cache(hkv, d, page_size, dtype)
    out: list[KernelRequest | None] = []

    def gemv_req(x, w, b, **kw):
        out.append(gemv.request(x, w, b, target=target, arch=arch, **kw))

    def rope(t: int) -> RopeWrite:
        cos = _meta(t, d, dtype=torch.float32)
        return RopeWrite(cos, cos, g, cache, cache, _meta(t, dtype=torch.int64))

    # a batch-1 decode step (and the last block's one sampled row of a prefill)
    x1 = m(1, hidden)
    for residual in (None, x1):
        gemv_req(x1, w_qkv, b_qkv, norm=(residual, ln_w, ln_b, eps), rope=rope(1))
        gemv_req(x1, w_qkv, b_qkv, norm=(residual, ln_w, ln_b, eps))  # a one-token prefill chunk
    gemv_req(x1, w_up, b_up, gegelu_limit=config.gegelu_limit, norm=(x1, ln_w, ln_b, eps))
    gemv_req(x1, w_up, b_up, gegelu_limit=config.gegelu_limit)  # the last block's sampled row
    gemv_req(m(1, ff), w_down, b_down)
    gemv_req(m(1, h * d), w_o, b_o)
    gemv_req(x1, w_lm, None, norm=(x1, ln_w, ln_b, eps))

    # steps of 2..32 rows: gemm_rows and PDL launches exist on Hopper only (clusters,
    # griddepcontrol); elsewhere those steps run cuBLAS and a plain add + LayerNorm
    hopper = parse_arch(arch) // 10 == 9
    for n, k, bias, gegelu_on, rope_on in ((qkv_rows, hidden, True, False, True), (qkv_rows, hidden, True, False, False),
                                           (2 * ff, hidden, True, True, False), (hidden, h * d, True, False, False)):  # fmt: skip
        if hopper and (n, k) in ROWS_LAYERS:
            build = gemm_rows.build_for(
                n, k, dtypes.name(dtype), bias, gegelu_on, (d, g) if rope_on else None
            )
            out.append(KernelRequest.of("gemm_rows", build, dtype=build.dtype, arch=arch))
    for rows in ROW_COUNTS:
        xr = m(rows, hidden)
        for residual in (None, xr):
            for pdl, trigger in ((True, True), (True, False)) if hopper else ((False, False),):
                out.append(add_norm.request(xr, residual, ln_w, ln_b, eps, pdl=pdl, trigger=trigger,
                                            target=target, arch=arch))  # fmt: skip

    # prefills
    out += _rotary_requests(hkv, g, d, cache, target, arch, dtype)
    for t in PREFILL_TOKENS:
        xt = m(t, hidden)
        for residual in (None, xt):
            out.append(add_norm.request(xt, residual, ln_w, ln_b, eps, pdl=False, trigger=False,
                                        target=target, arch=arch))  # fmt: skip
        out.append(gegelu.request(m(t, 2 * ff), config.gegelu_limit, arch=arch))
    if kv_dtype is not None:
        cache8, scales = _fp8_cache(hkv, d, page_size, kv_dtype)
        out += _rotary_requests(hkv, g, d, cache8, target, arch, dtype, scales)
    return list(dict.fromkeys(r for r in out if r is not None))


def decoder_kernel_requests(
    config: DecoderConfig,
    dtype: torch.dtype,
    arch: str,
    page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> list[KernelRequest]:
    """A decoder family's model kernels (kinds gemv, gemm_rows, rotary_kv_write, add_norm), as
    `families.blocks` launches them on an sm_90 GPU with the fused kernels and the GEMV on:
    - a batch-1 step: the GEMV for QKV (add + RMSNorm inside; the rotary and K/V write too
      unless the family norms q and k, or head_dim is not a power of two), gate_up (add +
      RMSNorm and SwiGLU / GeGLU inside; not for gpt-oss's experts), down_proj, o_proj and
      lm_head (+ the final add + RMSNorm);
    - 2..32 rows: `gemm_rows` for the weight shapes `ROWS_LAYERS` lists (QKV with the rotary
      epilogue at decode steps, plainly in a prefill; gate_up and o_proj plainly), add + RMSNorm
      launched with PDL (triggering the GEMM after it or not);
    - prefills: add + RMSNorm and the rotary kernel (Gemma's sandwich norms also without a
      residual). Each request once, in a stable order."""
    target = aot_target(arch)
    cfg = config
    hidden, ff, vocab, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    h, hkv, g = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.group_size
    qkv_rows = (h + 2 * hkv) * d
    kind = {0.0: "rms", 1.0: "rms1p"}.get(cfg.norm_offset)
    m = lambda *shape: _meta(*shape, dtype=dtype)  # noqa: E731 - a short name for many shapes
    ln_w, eps = m(hidden), cfg.rms_norm_eps
    bias = lambda on, n: m(n) if on else None  # noqa: E731
    w_qkv, b_qkv, w_o, b_o = (
        m(qkv_rows, hidden),
        bias(cfg.qkv_bias, qkv_rows),
        m(hidden, h * d),
        bias(cfg.o_bias, hidden),
    )
    w_gu, b_gu, w_down, b_down = (
        m(2 * ff, hidden),
        bias(cfg.mlp_bias, 2 * ff),
        m(hidden, ff),
        bias(cfg.mlp_bias, hidden),
    )
    cache = _cache(hkv, d, page_size, dtype)
    pow2 = not d & (d - 1)
    rope_gemm = (
        pow2 and not cfg.qk_norm
    )  # the rotary in the GEMV / gemm_rows epilogue (Attention.rope_fusable)
    dense_mlp = not cfg.num_experts
    hopper = parse_arch(arch) // 10 == 9  # gemm_rows and PDL launches: Hopper only
    out: list[KernelRequest | None] = []
    if kind is None:  # no fused norm: every norm in torch (no family has such an offset)
        return []

    def gemv_req(x, w, b, **kw):
        out.append(gemv.request(x, w, b, target=target, arch=arch, **kw))

    def norm_req(x, residual, pdl, trigger):
        out.append(add_norm.request(x, residual, ln_w, None, eps, pdl=pdl, trigger=trigger, target=target,
                                    arch=arch, kind=kind))  # fmt: skip

    x1 = m(1, hidden)
    for residual in (None, x1):
        norm = (residual, ln_w, None, eps)
        if rope_gemm:
            cos = _meta(1, d, dtype=torch.float32)
            rope = RopeWrite(cos, cos, g, cache, cache, _meta(1, dtype=torch.int64))
            gemv_req(x1, w_qkv, b_qkv, norm=norm, norm_kind=kind, rope=rope)
        gemv_req(x1, w_qkv, b_qkv, norm=norm, norm_kind=kind)
    if dense_mlp:
        gemv_req(x1, w_gu, b_gu, glu=cfg.act, norm=(x1, ln_w, None, eps), norm_kind=kind)
        gemv_req(m(1, ff), w_down, b_down)
    gemv_req(m(1, h * d), w_o, b_o)
    gemv_req(x1, m(vocab, hidden), None, norm=(x1, ln_w, None, eps), norm_kind=kind)
    if cfg.sandwich or not dense_mlp:  # the sandwich norms, and the add + norm before the experts
        norm_req(x1, None, hopper, False)
        norm_req(x1, x1, hopper, False)

    gemms = [(qkv_rows, hidden, b_qkv is not None, rope_gemm), (qkv_rows, hidden, b_qkv is not None, False),
             (hidden, h * d, b_o is not None, False)]  # fmt: skip
    if dense_mlp:
        gemms.append((2 * ff, hidden, b_gu is not None, False))
    for n, k, has_bias, rope_on in gemms:
        if hopper and (n, k) in ROWS_LAYERS:
            build = gemm_rows.build_for(
                n, k, dtypes.name(dtype), has_bias, False, (d, g) if rope_on else None
            )
            out.append(KernelRequest.of("gemm_rows", build, dtype=build.dtype, arch=arch))
    for rows in ROW_COUNTS:
        xr = m(rows, hidden)
        for residual in (None, xr):
            for pdl, trigger in ((True, True), (True, False)) if hopper else ((False, False),):
                norm_req(xr, residual, pdl, trigger)
    if pow2:
        out += _rotary_requests(hkv, g, d, cache, target, arch, dtype)
        if kv_dtype is not None:
            cache8, scales = _fp8_cache(hkv, d, page_size, kv_dtype)
            out += _rotary_requests(hkv, g, d, cache8, target, arch, dtype, scales)
    for t in PREFILL_TOKENS:
        xt = m(t, hidden)
        for residual in (None, xt):
            norm_req(xt, residual, False, False)
    return list(dict.fromkeys(r for r in out if r is not None))
