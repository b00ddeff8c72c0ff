"""The oracle: plain PyTorch block-sparse attention that every kernel is tested against.

It runs anywhere, computes in float32 (float64 when the inputs are float64), and is also the
CPU fallback of `sparsegen.prefill` / `sparsegen.paged_decode`. Queries are processed in
chunks, so memory grows with chunk x keys x heads, never with keys^2.

Per query head h, with s_j = scale * q.k_j over the visible keys j (DESIGN §1):
  soft-cap (layer.logit_softcap = c > 0)   s_j <- c * tanh(s_j / c)
  learned sinks (layer.learned_sinks)      out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sinks[h]})
  fp8 K/V (k_scale, v_scale)               k_j = k_j.float() * k_scale[kv_head], likewise v
"""

from __future__ import annotations

import torch

from .layout import layer_visible
from .spec import LayerSpec
from .validate import check_decode_inputs, check_prefill_inputs, layer_scale

# Elements of one [H, chunk, keys] score tensor; bounds the reference's working memory.
_SCORE_BUDGET = 1 << 24


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def attend(
    q: torch.Tensor,  # [n_q, H, D], queries at positions q_pos
    k: torch.Tensor,  # [n_k, Hkv, D], keys at positions 0..n_k-1
    v: torch.Tensor,  # [n_k, Hkv, D]
    q_pos: torch.Tensor,  # [n_q] int64, absolute positions, each < n_k
    layer: LayerSpec,
    scale: float,
    sinks: torch.Tensor | None = None,  # [H] float32 when layer.learned_sinks
    k_scale: torch.Tensor | None = None,  # [Hkv] or [] float32 when k is fp8
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [n_q, H, D] in the math dtype
    """Masked softmax attention of one sequence, chunked over queries."""
    dt = _math_dtype(q)
    group = layer.group_size
    n_q, n_k = q.shape[0], k.shape[0]
    out = torch.empty(n_q, layer.num_heads, layer.head_dim, dtype=dt, device=q.device)
    if n_q == 0:
        return out
    # kf, vf: [H, n_k, D], each KV head repeated for the query heads it serves
    kf = _dequantised(k, k_scale, dt).repeat_interleave(group, dim=1).transpose(0, 1)
    vf = _dequantised(v, v_scale, dt).repeat_interleave(group, dim=1).transpose(0, 1)
    softcap = layer.logit_softcap
    # sink: [H, 1, 1] logits, one extra softmax column per head that carries no value
    sink = None if sinks is None else sinks.to(dt).view(-1, 1, 1)
    chunk = max(1, _SCORE_BUDGET // max(1, layer.num_heads * n_k))
    k_pos = torch.arange(n_k, device=q.device)
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        pos = q_pos[start:stop]
        last = int(pos.max()) + 1  # causal: keys past the last query in the chunk are unseen
        qc = q[start:stop].to(dt).transpose(0, 1)  # [H, c, D]
        scores = torch.matmul(qc, kf[:, :last].transpose(1, 2)) * scale  # [H, c, last]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        mask = layer_visible(layer, pos.to(q.device), k_pos[:last])  # [H, c, last]
        scores = scores.masked_fill(~mask, float("-inf"))
        if sink is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # softmax over [keys, sink], then drop the sink's column
            probs = torch.softmax(torch.cat([scores, sink.expand(-1, stop - start, 1)], dim=-1), dim=-1)[
                ..., :-1
            ]
        out[start:stop] = torch.matmul(probs, vf[:, :last]).transpose(0, 1)
    return out


def _dequantised(t: torch.Tensor, scale: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor:
    """t ([n, Hkv, D]) in the math dtype; fp8 values times their KV head's scale ([Hkv] or [])."""
    if scale is None:
        return t.to(dt)
    return t.to(dt) * scale.to(dt).reshape(1, -1, 1)


def prefill(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    cu_seqlens_k: torch.Tensor,  # [B+1] int32
    layer: LayerSpec,
    scale: float | None = None,
    *,
    sinks: torch.Tensor | None = None,  # [H] float32, exactly when layer.learned_sinks
    k_scale: torch.Tensor | None = None,  # [Hkv] or [] float32, exactly when k/v are fp8
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [Tq, H, D], q.dtype
    """Varlen block-sparse prefill; sequence b's queries are the last q_len of its k_len keys."""
    check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, layer, allow_cpu=True, sinks=sinks,
                         k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    scale = layer_scale(scale, layer)
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        n_q, n_k = q1 - q0, k1 - k0
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
        out[q0:q1] = attend(q[q0:q1], k[k0:k1], v[k0:k1], q_pos, layer, scale, sinks, k_scale, v_scale).to(
            q.dtype
        )
    return out


def gather_pages(
    cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    pages: torch.Tensor,  # [n] page ids
    seq_len: int,
) -> torch.Tensor:  # [seq_len, Hkv, D]
    """The first seq_len tokens of one sequence, read through its page list."""
    return cache[pages.long()].flatten(0, 1)[:seq_len]


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    layer: LayerSpec,
    scale: float | None = None,
    *,
    sinks: torch.Tensor | None = None,  # [H] float32, exactly when layer.learned_sinks
    k_scale: torch.Tensor | None = None,  # [Hkv] or [] float32, exactly when the caches are fp8
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, H, D], q.dtype
    """One decode step: each sequence's query sits at position seq_len - 1."""
    check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, layer, allow_cpu=True, check_pages=True,
                        sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    scale = layer_scale(scale, layer)
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        pages = block_tables[b, : -(-n // page_size)]
        k = gather_pages(k_cache, pages, n)
        v = gather_pages(v_cache, pages, n)
        q_pos = torch.tensor([n - 1], device=q.device)
        out[b] = attend(q[b : b + 1], k, v, q_pos, layer, scale, sinks, k_scale, v_scale)[0].to(q.dtype)
    return out
