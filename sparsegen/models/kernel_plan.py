"""The compiled kernels a Phi-3-Small model launches besides attention, as lifecycle requests, so
that `sparsegen compile --model-kernels` builds them ahead of time (no GPU needed).

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
from .kv_scales import KVScales
from .layers import ROWS_LAYERS

ROW_COUNTS = (2, 32)  # rows of a few-row step: gemm_rows' and add + LayerNorm's PDL range
PREFILL_TOKENS = (64, rotary.ROTARY_TILED_FROM)  # a short and a long prefill chunk


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def model_kernel_requests(
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
    cache = m(4, hkv, page_size, d).transpose(1, 2)  # [pages, page_size, Hkv, D], head-major
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
    for t in (1, *ROW_COUNTS, *PREFILL_TOKENS):
        qkv = m(t, hkv, g + 2, d)
        cos = _meta(t, d, dtype=torch.float32)
        slots = _meta(t, dtype=torch.int64)
        out.append(rotary.request(qkv, cos, cos, (cache, cache), slots, target=target, arch=arch))
    for t in PREFILL_TOKENS:
        xt = m(t, hidden)
        for residual in (None, xt):
            out.append(add_norm.request(xt, residual, ln_w, ln_b, eps, pdl=False, trigger=False,
                                        target=target, arch=arch))  # fmt: skip
        out.append(gegelu.request(m(t, 2 * ff), config.gegelu_limit, arch=arch))
    if kv_dtype is not None:
        cache8 = _meta(4, hkv, page_size, d, dtype=kv_dtype).transpose(1, 2)  # fp8, head-major
        scales = KVScales(hkv, kv_dtype, "meta")  # k, v: [Hkv] float32
        for t in (1, *ROW_COUNTS, *PREFILL_TOKENS):
            qkv, cos, slots = (
                m(t, hkv, g + 2, d),
                _meta(t, d, dtype=torch.float32),
                _meta(t, dtype=torch.int64),
            )
            out.append(rotary.request(qkv, cos, cos, (cache8, cache8), slots, target=target, arch=arch,
                                      scales=scales))  # fmt: skip
    return list(dict.fromkeys(r for r in out if r is not None))
