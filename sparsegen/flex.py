"""Hand a sparsegen spec to PyTorch's FlexAttention.

    from torch.nn.attention.flex_attention import flex_attention
    from sparsegen import flex

    bm = flex.block_mask(layer, n_q, n_k, device="cuda")          # a FlexAttention BlockMask
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)   # q: [1, H, n_q, D]

`mask_mod(layer, n_q, n_k)` is the function FlexAttention calls per (batch, head, query, key)
index; it says exactly what `sparsegen.visible_mask(layer, n_q, n_k)` says (DESIGN §1; the
queries are the last n_q of n_k positions). Fields every head shares are Python constants, so
FlexAttention's generated kernel does plain integer arithmetic on them; only fields that differ
per head are looked up in small tensors by head index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import InputError
from .spec import MAX_SEQ_LEN, LayerSpec

_FIELDS = (
    "block_size",
    "local_blocks",
    "vert_stride",
    "vert_offset",
    "sliding_window",
    "dense",
    "sink_tokens",
)


def _check(layer: object, n_q: object, n_k: object) -> tuple[int, int]:
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
    n_k = n_q if n_k is None else n_k
    for name, value in (("n_q", n_q), ("n_k", n_k)):
        if type(value) is not int or not 1 <= value <= MAX_SEQ_LEN:
            raise InputError(f"{name} must be an int in 1..{MAX_SEQ_LEN}, got {value!r:.40}")
    if n_q > n_k:
        raise InputError(f"n_q must be <= n_k (the queries are the last n_q keys), got n_q={n_q}, n_k={n_k}")
    return n_q, n_k


def _device(device: object) -> torch.device:
    """None (the CPU), or a str / torch.device naming the CPU or a CUDA GPU torch can see."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise InputError(f"device must be a str or torch.device, got {type(device).__name__}: {device!r:.40}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise InputError(
            f"device {device!r:.40} is not a torch device (use 'cpu', 'cuda' or 'cuda:N')"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be a cpu or cuda device, got {device!r:.40}")
    count = torch.cuda.device_count() if dev.type == "cuda" and torch.cuda.is_available() else 0
    if dev.type == "cuda" and (count == 0 or (dev.index or 0) >= count):
        raise InputError(f"device {device!r:.40} was asked for, but torch sees {count} CUDA GPU(s)")
    return dev


def mask_mod(layer: LayerSpec, n_q: int, n_k: int | None = None, *, device=None) -> Callable:
    """FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool` for `layer` with n_q queries over
    n_k keys (n_k defaults to n_q). `device` is where FlexAttention will run (default cpu): the
    per-head tables live there."""
    n_q, n_k = _check(layer, n_q, n_k)
    device = _device(device)
    table: dict[str, int | torch.Tensor] = {}
    for name in _FIELDS:
        values = [int(getattr(h, name)) for h in layer.heads]
        table[name] = values[0] if len(set(values)) == 1 else torch.tensor(values, device=device)
    shift = n_k - n_q  # query row r is position shift + r

    def field(name: str, h):
        value = table[name]
        return value[h] if isinstance(value, torch.Tensor) else value

    def mod(b, h, q_idx, kv_idx):
        i, j = q_idx + shift, kv_idx
        causal = j <= i
        dense = table["dense"]
        if isinstance(dense, int) and dense:  # every head dense
            return causal
        bs = field("block_size", h)
        seen = (i - j) < field("sliding_window", h)  # a window of 0 sees nothing: i - j >= 0
        local = table["local_blocks"]
        if isinstance(local, torch.Tensor) or local:
            seen = seen | ((i // bs - j // bs) < field("local_blocks", h))
        stride = table["vert_stride"]
        if isinstance(stride, torch.Tensor):  # heads without a stride (0) never match
            hit = (j // bs + field("vert_offset", h) + 1) % stride[h].clamp(min=1) == 0
            seen = seen | ((stride[h] > 0) & hit)
        elif stride:
            seen = seen | ((j // bs + field("vert_offset", h) + 1) % stride == 0)
        sinks = table["sink_tokens"]
        if isinstance(sinks, torch.Tensor) or sinks:  # keys 0..n-1 (StreamingLLM's sink tokens)
            seen = seen | (j < field("sink_tokens", h))
        if isinstance(dense, torch.Tensor):
            seen = seen | (dense[h] > 0)
        return causal & seen

    return mod


def block_mask(
    layer: LayerSpec,
    n_q: int,
    n_k: int | None = None,
    *,
    device="cpu",
    block_size: int | tuple[int, int] = 128,
    compile: bool = False,
):
    """A FlexAttention `BlockMask` of `mask_mod(layer, n_q, n_k)` for every head of `layer`,
    broadcast over the batch. `block_size` is FlexAttention's tile
    (query, key); `compile=True` builds the mask with torch.compile (faster for long sequences
    on a GPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n_q, n_k = _check(layer, n_q, n_k)
    sizes = (block_size, block_size) if isinstance(block_size, int) else block_size
    sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else sizes
    if (
        not isinstance(sizes, tuple)
        or len(sizes) != 2
        or any(type(s) is not int or s < 16 or s % 16 for s in sizes)
    ):
        raise InputError(f"block_size must be a multiple of 16 (or a pair of them), got {block_size!r:.40}")
    if not isinstance(compile, bool):
        raise InputError(f"compile must be a bool, got {compile!r:.40}")
    device = _device(device)
    mod = mask_mod(layer, n_q, n_k, device=device)
    return create_block_mask(  # B=None: one mask broadcast over the batch
        mod, None, layer.num_heads, n_q, n_k, device=device, BLOCK_SIZE=sizes, _compile=compile
    )


def score_mod(layer: LayerSpec) -> Callable | None:
    """FlexAttention's `score_mod(score, b, h, q_idx, kv_idx)` for the layer's soft-cap: the
    scaled score s becomes c * tanh(s / c). None when the layer has no soft-cap."""
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a LayerSpec, got {type(layer).__name__}")
    cap = float(layer.logit_softcap)
    if not cap:
        return None

    def mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return mod


def apply_learned_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Learned sinks after FlexAttention, which has no sink argument: with `return_lse=True` it
    gives out = sum_j e^{s_j} v_j / Z and lse = log Z per (batch, head, query); a sink logit adds
    e^{sink[h]} to Z alone, so the answer is out * Z / (Z + e^{sink}) = out * sigmoid(lse - sink).
    out: [B, H, n, D], lse: [B, H, n] (natural log), sinks: [H] float32 -> [B, H, n, D]."""
    if out.dim() != 4 or lse.shape != out.shape[:3] or sinks.shape != (out.shape[1],):
        raise InputError(
            f"want out [B, H, n, D], lse [B, H, n] and sinks [H]; got {list(out.shape)}, {list(lse.shape)}, "
            f"{list(sinks.shape)}"
        )
    weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # [B, H, n]
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)
