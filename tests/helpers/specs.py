"""Specs and a visibility oracle that more than one test module uses."""

from __future__ import annotations

from sparsegen import HeadSpec, LayerSpec
from sparsegen.spec import MAX_SEQ_LEN

MAX = MAX_SEQ_LEN


def sees(head, i: int, j: int) -> bool:
    """DESIGN §1 written out literally, one pair at a time (the independent implementation)."""
    if j > i:
        return False
    if head.dense:
        return True
    b = head.block_size
    local = head.local_blocks > 0 and i // b - j // b < head.local_blocks
    vert = head.vert_stride > 0 and (j // b + head.vert_offset + 1) % head.vert_stride == 0
    window = head.sliding_window > 0 and i - j < head.sliding_window
    return local or vert or window


def extreme_layer() -> LayerSpec:
    """Four heads at the clamps and the largest allowed stride/offset."""
    heads = (
        HeadSpec(block_size=16, local_blocks=2**70),  # clamped to MAX // 16
        HeadSpec(block_size=256, local_blocks=2**28, vert_stride=MAX // 256, vert_offset=MAX // 256 - 1),
        HeadSpec(block_size=64, sliding_window=2**63),  # clamped to MAX
        HeadSpec(block_size=16, local_blocks=1, vert_stride=MAX // 16, vert_offset=MAX // 16 - 1,
                 sliding_window=MAX - 1),
    )  # fmt: skip
    return LayerSpec(4, 1, 64, heads)


def eight_class_hybrid_layer() -> LayerSpec:
    """32 heads over 8 KV heads (GQA 4) whose 8 head groups all differ: 8 pattern classes."""
    heads = tuple(
        HeadSpec(block_size=16 << (h % 4), local_blocks=1 + h % 3, vert_stride=2 + h % 5, vert_offset=h % 2,
                 sliding_window=0 if h % 3 else 50 + h)
        for h in range(32)
    )  # fmt: skip
    return LayerSpec(32, 8, 128, heads)
