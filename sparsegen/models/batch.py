"""`ForwardBatch`: what one forward pass needs to know besides the token ids.

A batch is either a prefill (several sequences, each the last `q_len` of its `k_len`
positions) or a decode step (one new token per sequence, read over the paged cache). The
engine builds these; `ForwardBatch.whole_sequences` builds the cache-free one used by the
plain full-recompute forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    is_decode: bool
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    use_long_rope: torch.Tensor | None = None  # [T] bool: LongRoPE long factors for this token
    logits_index: torch.Tensor | None = None  # [B] int64 rows whose logits are wanted; None: all
    # prefill
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32, new tokens
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32, cached prefix + new tokens
    max_seqlen_q: int | None = None  # longest q_len / k_len of the batch, known on the host: the
    max_seqlen_k: int | None = None  # prefill kernel then sizes its grid without reading cu_seqlens
    # [2, Tk] int64: the cache page and the offset in it of every key; None: keys = new tokens
    kv_gather: torch.Tensor | None = None
    # cache writes (prefill and decode); None: no cache
    slot_mapping: torch.Tensor | None = None  # [T] int64 flat slot (page * page_size + offset)
    # decode
    block_tables: torch.Tensor | None = None  # [B, max_pages] int32
    seq_lens: torch.Tensor | None = None  # [B] int32, including the new token
    # prefill with a cache: the page tables and lengths of the sequences whose logits are wanted
    # (logits_index's rows, in its order). With them the last layer attends from just those rows,
    # over the cache its QKV step has just written, and runs its O projection and MLP on just
    # them (`Phi3SmallForCausalLM.forward`); None: the last layer runs on every row.
    sampled_block_tables: torch.Tensor | None = None  # [len(logits_index), max_pages] int32
    sampled_seq_lens: torch.Tensor | None = None  # [len(logits_index)] int32

    @classmethod
    def whole_sequences(cls, lengths: list[int], device: torch.device | str = "cpu") -> ForwardBatch:
        """Prefill of whole sequences with no cache; logits for every position."""
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        longest = max(lengths)
        return cls(
            is_decode=False,
            positions=positions,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
        )
