"""Grammar masks on the logits: which tokens a constrained row may take next.

The engine's grammar matchers (`engine.structured_output`) write one bitmask row per sampled
row before a step is launched: int32 words, bit `t % 32` of word `t // 32` set where token `t`
is allowed (llguidance's layout). The sampler (`runner.sampling`) applies them to the logits
after the model's forward pass (outside any CUDA graph: the graphs end at the logits), before
logit_bias, allowed_token_ids, min_tokens and penalties, for the rows whose request is
constrained; the other rows of the batch are untouched.

What a mask leaves is checked on the host first, so that a row no token could satisfy fails
that request alone (`runner.isolation`) instead of sampling a token outside the grammar.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import InputError
from ..request.sampling_params import SamplingParams
from .transfer import on_device, to_device


def words_for(vocab_size: int) -> int:
    """Int32 words of one bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """row: [W] int32 bitmask -> the allowed token ids (int64, ascending) below vocab_size."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def constrained_rows(params: Sequence[SamplingParams]) -> list[int]:
    return [r for r, p in enumerate(params) if p.has_structured_output]


def check_masks(bitmask: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int) -> None:
    """Raise InputError if a constrained row's mask leaves no token, or none of its
    `allowed_token_ids` (bitmask: [B, W] int32 on the host)."""
    for r in constrained_rows(params):
        ids = allowed_ids(bitmask[r].numpy(), vocab_size)
        if ids.size == 0:
            raise InputError("the request's grammar allows no next token")
        allowed = params[r].allowed_token_ids
        if allowed is not None and not np.isin(ids, np.asarray(allowed, dtype=np.int64)).any():
            raise InputError("the request's allowed_token_ids and its grammar leave no token to sample")


def mask_allows_beyond(bitmask_row: torch.Tensor, banned: set[int], vocab_size: int) -> bool:
    """Does the row's grammar allow some token outside `banned`? (min_tokens bans EOS and the stop
    tokens only while the grammar leaves something else.)"""
    ids = allowed_ids(bitmask_row.numpy(), vocab_size)
    return bool(ids.size > len(banned) or not set(ids.tolist()) <= banned)


def apply_token_bitmask(
    x: torch.Tensor,  # [B, V] float32 logits
    bitmask: torch.Tensor,  # [B, W] int32 on the host, W = words_for(V) or more
    params: Sequence[SamplingParams],
) -> torch.Tensor:
    """x with -inf at every token the grammar of a constrained row forbids; other rows as they
    are. The bits are unpacked on x's device (one copy of the constrained rows' words)."""
    rows = constrained_rows(params)
    if not rows:
        return x
    b, v = x.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != b or bitmask.dtype != torch.int32:
        raise InputError(
            f"a token bitmask must be [{b}, W] int32, got {tuple(bitmask.shape)} {bitmask.dtype}"
        )
    dev = x.device
    words = to_device(bitmask[rows], dev)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=dev)  # [32]
    bits = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)  # [R, W * 32]
    if bits.shape[1] < v:  # tokens past the mask's width are never allowed
        bits = torch.nn.functional.pad(bits, (0, v - bits.shape[1]))
    keep = bits[:, :v].bool()  # [R, V]
    idx = on_device(dev, rows)
    out = x.clone()
    out[idx] = x[idx].masked_fill(~keep, -math.inf)
    return out
