"""The key tiles one query tile of the Gluon prefill kernel visits, as a pure function.

`tiles(head, ...)` computes, in plain Python, the same numbers the template's `_schedule` and
`_tile_start` compute on the GPU: which BLOCK_N-wide key tiles a query tile loads, in order, and
which of them need a token mask (sink tokens on a head without vertical blocks: tiles from key 0
below the near range, in the vertical tiles' place). The CPU tests check it against
`sparsegen.visible_mask` on fuzzed specs: every visible (query, key) pair is in some tile, an unmasked tile is fully visible
to every live row, and no loaded tile is invisible to all of them. Keep it in step with
`templates/prefill_gluon_schedule.py.jinja`, the part of the Gluon template it mirrors (the GPU
tests then check the kernel itself).
"""

from __future__ import annotations

from ..spec import HeadSpec


def _near(x: int, head: HeadSpec) -> int:
    """First key of the near range (local blocks and/or window) of the query at position x."""
    starts = []
    if head.local_blocks:
        starts.append((x // head.block_size - (head.local_blocks - 1)) * head.block_size)
    if head.sliding_window:
        starts.append(x - (head.sliding_window - 1))
    return min(starts)


def _bounds(head: HeadSpec, m0: int, q_len: int, k_len: int, block_m: int, block_n: int):
    """The numbers `_schedule` computes for one query tile: lo (first key of the near range,
    moved down to a vertical kb_lo's first key), the near tiles' start a, masked-below b,
    diagonal d, one past the last live row hi, and kb_lo; None for a tile with no live row."""
    first = k_len - q_len
    if not (m0 < k_len and m0 + block_m > first):
        return None
    top = max(m0, first)
    hi = min(m0 + block_m, k_len)
    last = hi - 1
    vert = 0 if head.dense else head.vert_stride
    kb_lo = 0
    if head.dense:
        lo = full = 0
    else:
        lo = max(_near(top, head), 0)
        full = max(_near(last, head), 0)
        if vert:  # vertical blocks lie below block kb_lo; a vertical kb_lo is seen whole
            kb_lo = lo // head.block_size
            if (kb_lo + head.vert_offset + 1) % vert == 0:
                lo = kb_lo * head.block_size
    a = lo // block_n * block_n
    d = max(a, m0 // block_n * block_n)
    b = min(max(-(-full // block_n) * block_n, a), d)
    return lo, a, b, d, hi, kb_lo


def tiles(
    head: HeadSpec, m0: int, q_len: int, k_len: int, *, block_m: int = 128, block_n: int = 64
) -> list[tuple[int, bool]]:
    """(first key, masked) of every key tile the query tile at position m0 visits, in order.

    Query row r of the sequence sits at position k_len - q_len + r; the tile holds positions
    [m0, m0 + block_m). Returns [] for a tile with no live query row (the kernel exits)."""
    found = _bounds(head, m0, q_len, k_len, block_m, block_n)
    if found is None:
        return []
    lo, a, b, d, hi, kb_lo = found
    vert = 0 if head.dense else head.vert_stride
    out: list[tuple[int, bool]] = []
    if vert:
        bs, tpb = head.block_size, head.block_size // block_n
        kb0 = vert - 1 - head.vert_offset
        n_vert = max(kb_lo - kb0 + vert - 1, 0) // vert * tpb
        out += [(kb0 * bs + (j // tpb) * vert * bs + (j % tpb) * block_n, False) for j in range(n_vert)]
    elif head.sink_tokens:  # sink tiles from key 0 below the near range, masked past sk
        sk = min(a, head.sink_tokens)
        out += [(n0, n0 + block_n > sk) for n0 in range(0, sk, block_n)]
    for n0 in range(a, hi, block_n):
        out.append((n0, n0 < b or n0 >= d))
    return out


def pair_tiles(
    head: HeadSpec, m0: int, q_len: int, k_len: int, *, block_m: int = 128, block_n: int = 128
) -> tuple[list[tuple[int, int, bool, bool]], int]:
    """The `vpair` schedule: ([(n0, n1, masked, hole), ...], lo). A key tile is two chunks of
    block_n // 2 keys starting at n0 and n1: chunks 2j and 2j + 1 of the head's vertical blocks
    (an odd last chunk pairs with itself: `hole`, its second copy counts nothing), then the near
    range in whole tiles (n1 = n0 + block_n // 2). Masked tiles count only keys >= lo the head
    sees; unmasked ones count every key."""
    found = _bounds(head, m0, q_len, k_len, block_m, block_n)
    if found is None:
        return [], 0
    lo, a, b, d, hi, kb_lo = found
    half = block_n // 2
    vert = 0 if head.dense else head.vert_stride
    out: list[tuple[int, int, bool, bool]] = []
    if vert:
        bs, cpb = head.block_size, head.block_size // half
        kb0 = vert - 1 - head.vert_offset
        n_chunks = max(kb_lo - kb0 + vert - 1, 0) // vert * cpb

        def start(c: int) -> int:
            return kb0 * bs + (c // cpb) * vert * bs + (c % cpb) * half

        for j in range((n_chunks + 1) // 2):
            c1 = min(2 * j + 1, n_chunks - 1)
            out.append((start(2 * j), start(c1), False, c1 == 2 * j))
    elif head.sink_tokens:  # sink chunks from key 0 below the near range, paired; masked past sk
        sk = min(a, head.sink_tokens)
        n_chunks = -(-sk // half)
        for j in range((n_chunks + 1) // 2):
            c1 = min(2 * j + 1, n_chunks - 1)
            out.append((2 * j * half, c1 * half, 2 * j * half + block_n > sk, c1 == 2 * j))
    for n0 in range(a, hi, block_n):
        out.append((n0, n0 + half, n0 < b or n0 >= d, False))
    return out, lo
