"""Where a pattern lets each query look: token masks, key counts, block and page maps.

Everything here is vectorised torch and memory-bounded: `density` and `visible_counts`
count visible keys in closed form (O(seq_len) per head), never through an [S, S] mask.

Positions are absolute within a sequence. With more keys than queries, query row r sits at
position `n_k - n_q + r` (bottom-right alignment, DESIGN §1).

The public functions take exact arguments: a `LayerSpec`, and lengths that are ints (not bools,
not floats such as 4.5) in 1..MAX_SEQ_LEN. Anything else is an `InputError` naming the argument.
"""

from __future__ import annotations

import torch

from .errors import InputError
from .spec import MAX_SEQ_LEN, HeadSpec, LayerSpec

# The most elements visible_mask materialises ([H, n_q, n_k] bools, 2 GiB): beyond it, count
# with density/visible_counts or look at tiles with block_mask.
MAX_MASK_ELEMENTS = 2**31


def check_layer(layer: object, name: str = "layer") -> LayerSpec:
    if not isinstance(layer, LayerSpec):
        raise InputError(f"{name} must be a sparsegen.LayerSpec, got {type(layer).__name__}: {layer!r:.80}")
    return layer


def check_length(name: str, value: object, minimum: int = 1, maximum: int = MAX_SEQ_LEN) -> int:
    """An exact int in minimum..maximum (a bool or a float such as 8.0 is refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an int, got {type(value).__name__}: {value!r:.80}")
    if not minimum <= value <= maximum:
        raise InputError(f"{name} must be in {minimum}..{maximum}, got {value}")
    return value


def head_visible(head: HeadSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool tensor, broadcast of q_pos and k_pos: may query position i see key position j."""
    i, j = q_pos, k_pos
    causal = j <= i
    if head.dense:
        return causal & torch.ones_like(causal)
    bs = head.block_size
    seen = torch.zeros_like(causal)
    if head.local_blocks:
        seen |= (i // bs - j // bs) < head.local_blocks
    if head.vert_stride:
        seen |= (j // bs + head.vert_offset + 1) % head.vert_stride == 0
    if head.sliding_window:
        seen |= (i - j) < head.sliding_window
    if head.sink_tokens:
        seen |= j < head.sink_tokens
    return causal & seen


def layer_visible(layer: LayerSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[H, len(q_pos), len(k_pos)] bool, one distinct head pattern computed once."""
    i, j = q_pos.reshape(-1, 1), k_pos.reshape(1, -1)
    cache: dict[HeadSpec, torch.Tensor] = {}
    planes = []
    for head in layer.heads:
        if head not in cache:
            cache[head] = head_visible(head, i, j)
        planes.append(cache[head])
    return torch.stack(planes)


def visible_mask(layer: LayerSpec, n_q: int, n_k: int | None = None) -> torch.Tensor:
    """[H, n_q, n_k] bool mask; the queries are the last n_q of n_k positions."""
    layer = check_layer(layer)
    n_q = check_length("n_q", n_q, minimum=0)
    n_k = n_q if n_k is None else check_length("n_k", n_k, minimum=0)
    if n_q > n_k:
        raise InputError(f"visible_mask needs n_q <= n_k, got n_q={n_q}, n_k={n_k}")
    if layer.num_heads * n_q * n_k > MAX_MASK_ELEMENTS:
        raise InputError(
            f"visible_mask would hold {layer.num_heads} x {n_q} x {n_k} elements (at most "
            f"{MAX_MASK_ELEMENTS}); use density(), visible_counts() or block_mask() at this length"
        )
    q_pos = torch.arange(n_k - n_q, n_k)
    return layer_visible(layer, q_pos, torch.arange(n_k))


def _vertical_keys_below(head: HeadSpec, n: torch.Tensor) -> torch.Tensor:
    """How many keys j < n lie in vertical-stride blocks."""
    bs, v, o = head.block_size, head.vert_stride, head.vert_offset
    full = n // bs
    # Block kb is vertical iff kb = v-1-o (mod v): among blocks 0..full-1 there are (full+o)//v.
    count = (full + o) // v * bs
    partial_is_vertical = (full + o + 1) % v == 0
    return count + torch.where(partial_is_vertical, n - full * bs, torch.zeros_like(n))


def near_start(head: HeadSpec, q_pos: torch.Tensor) -> torch.Tensor:
    """First key of the contiguous range [near_start, i] that query i sees through its local
    blocks, window or density; vertical blocks and sink tokens add keys only below it.
    Non-decreasing in i."""
    i = q_pos.to(torch.int64)
    if head.dense:
        return torch.zeros_like(i)
    # The local and window parts both end at the diagonal, so together they are one range.
    near = torch.full_like(i, torch.iinfo(torch.int64).max)
    if head.local_blocks:
        near = torch.minimum(near, (i // head.block_size - head.local_blocks + 1) * head.block_size)
    if head.sliding_window:
        near = torch.minimum(near, i - head.sliding_window + 1)
    return near.clamp(min=0)


def head_key_counts(head: HeadSpec, q_pos: torch.Tensor) -> torch.Tensor:
    """Number of keys visible from each query position (closed form, int64)."""
    i = q_pos.to(torch.int64)
    near = near_start(head, i)
    count = i - near + 1
    if head.dense:
        return count
    if head.vert_stride:
        count = count + _vertical_keys_below(head, near)
    if head.sink_tokens:  # keys [0, min(sinks, near)), less those already counted as vertical
        sinks = torch.clamp(near, max=head.sink_tokens)
        count = count + sinks
        if head.vert_stride:
            count = count - _vertical_keys_below(head, sinks)
    return count


def visible_counts(layer: LayerSpec, positions: torch.Tensor) -> torch.Tensor:
    """[H, len(positions)] visible keys per head for queries at `positions`."""
    return torch.stack([head_key_counts(h, positions) for h in layer.heads])


def density(layer: LayerSpec, seq_len: int) -> torch.Tensor:
    """[H] float64: visible (query, key) pairs over causal pairs for one sequence."""
    layer = check_layer(layer)
    seq_len = check_length("seq_len", seq_len)
    pos = torch.arange(seq_len, dtype=torch.int64)
    causal = seq_len * (seq_len + 1) // 2
    # One [seq_len] count per distinct head (not an [H, seq_len] stack): memory stays O(seq_len).
    pairs: dict[HeadSpec, int] = {}
    for head in layer.heads:
        if head not in pairs:
            pairs[head] = int(head_key_counts(head, pos).sum())
    return torch.tensor([pairs[h] for h in layer.heads], dtype=torch.float64) / causal


def block_mask(layer: LayerSpec, seq_len: int, block: int) -> torch.Tensor:
    """[H, nb, nb] bool: does query tile a see anything in key tile b (tiles of `block` tokens).

    Closed form, exact for any tile size: the rows of tile a = [a0, a1] together see the
    contiguous range [near_start(a0), a1] plus the vertical-stride keys and the sink tokens at
    or below a1.
    """
    layer = check_layer(layer)
    seq_len = check_length("seq_len", seq_len)
    block = check_length("block", block)
    nb = -(-seq_len // block)
    if layer.num_heads * nb * nb > MAX_MASK_ELEMENTS:
        raise InputError(f"block_mask would hold {layer.num_heads} x {nb} x {nb} tiles; use a larger block")
    starts = torch.arange(nb) * block
    ends = torch.clamp(starts + block - 1, max=seq_len - 1)
    q_lo, q_hi = starts.view(nb, 1), ends.view(nb, 1)  # query tile a, as a column
    k_lo, k_hi = starts.view(1, nb), ends.view(1, nb)  # key tile b, as a row
    planes: dict[HeadSpec, torch.Tensor] = {}
    for head in layer.heads:
        if head in planes:
            continue
        near = near_start(head, q_lo)
        seen = (k_hi >= near) & (k_lo <= q_hi)
        if head.vert_stride and not head.dense:
            # Any vertical key in [k_lo, min(k_hi, q_hi)]: count vertical keys below each end.
            top = torch.minimum(k_hi, q_hi) + 1
            below = _vertical_keys_below(head, k_lo.expand_as(top))
            seen |= (top > k_lo) & (_vertical_keys_below(head, top) > below)
        if head.sink_tokens and not head.dense:
            seen |= (k_lo < head.sink_tokens) & (k_lo <= q_hi)
        planes[head] = seen
    return torch.stack([planes[h] for h in layer.heads])


def decode_pages(layer: LayerSpec, seq_len: int, page_size: int) -> torch.Tensor:
    """[Hkv, num_pages] bool: pages some head of each KV group needs for the query at seq_len-1."""
    layer = check_layer(layer)
    seq_len = check_length("seq_len", seq_len)
    page_size = check_length("page_size", page_size)
    k_pos = torch.arange(seq_len)
    vis = layer_visible(layer, torch.tensor([seq_len - 1]), k_pos)[:, 0]  # [H, seq_len]
    n_pages = -(-seq_len // page_size)
    vis = torch.nn.functional.pad(vis, (0, n_pages * page_size - seq_len))
    per_head = vis.view(layer.num_heads, n_pages, page_size).any(dim=2)
    return per_head.view(layer.num_kv_heads, layer.group_size, n_pages).any(dim=1)
