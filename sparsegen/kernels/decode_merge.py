"""How the paged-decode kernel's split-KV partials are merged: in the kernel or by a second one.

With more than one split, every block stores an unnormalised partial. Two merges exist (their
math and summation order are the same, so their outputs are bitwise equal;
templates/paged_decode_reduce.cuh.jinja):

- **fused** (no second launch): each (sequence, head group) has an int32 counter; a block bumps
  it after storing its partial, and the block that arrives last merges every split of its heads
  and sets the counter back to 0. One block per head group then reads all of that group's
  partials, `splits x heads_per_block x head_dim x 4` bytes (32 KB at 16 splits for
  Phi-3-Small's 4 heads x 128 dims);
- **separate**: the reduce kernel, one block per (sequence, head) row and 32-dim slice, which
  spreads that read over many SMs but costs a launch (~3 us a layer in a CUDA-graph step).

`use_fused` picks per launch: fused while one merging block reads at most FUSED_MAX_BYTES.

The counters live in a cache keyed by (device, stream): two launches in flight at once on
different streams must not share counters (each would count the other's blocks), while launches
on one stream run one after another, and each leaves its counters at zero for the next. A CUDA
graph keeps the counter address it captured; its launches run in capture order, so they share
that buffer as eager launches on one stream do (replaying two graphs captured on the same stream
concurrently on two streams is not supported, just as replaying one graph twice at once is not).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..errors import InputError

MERGES = ("fused", "separate")
# The fused merge's limit, in bytes of partials that the one merging block of a head group reads
# (splits x heads_per_block x head_dim x 4): 16 KB = 8 splits for Phi-3-Small (4 heads x 128
# dims). Measured on the H200 (`benchmarks/decode/tune_decode.py --merge-sweep`, us per launch,
# fused / separate): at 32 x 8K the in-kernel merge wins at every split count up to 32 (2 splits,
# the heuristic's pick: sparse 151.2 / 153.4, dense 265.2 / 268.0), but at 1 x 8K, where only 8
# blocks merge and they do it after everything else, it loses from 16 splits on (16: 15.3 /
# 14.5; 48, the heuristic's pick: 16.0 / 12.9 sparse, 16.0 / 12.5 dense) and ties at 2 and 8.
FUSED_MAX_BYTES = 16 * 1024
MIN_COUNTERS = 1024  # a first buffer's size: 4 KB, enough for batch 128 x 8 head groups
MAX_COUNTERS = 2**31 - 1


def use_fused(splits: int, heads_per_block: int, head_dim: int, merge: str | None = None) -> bool:
    """Whether a launch of `splits` splits merges in the kernel. `merge` overrides the rule:
    None (the rule), "fused" or "separate". One split needs no merge: always False."""
    if merge is not None and merge not in MERGES:
        raise InputError(f"merge must be None, 'fused' or 'separate', got {merge!r}")
    for name, value in (("splits", splits), ("heads_per_block", heads_per_block), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    if splits == 1:
        return False
    if merge is not None:
        return merge == "fused"
    return splits * heads_per_block * head_dim * 4 <= FUSED_MAX_BYTES


@dataclass
class _Counters:
    buffer: torch.Tensor  # [capacity] int32, all zero between launches
    retired: list[torch.Tensor] = field(default_factory=list)  # older, smaller buffers; see grow


class CounterCache:
    """Zero-initialised int32 counter buffers, one per (device, stream), grown as needed.

    A grown-out buffer is kept alive (never freed): a captured CUDA graph may still hold its
    address. The zeroing happens once, when a buffer is made; the kernel puts every counter it
    uses back to zero. Made during a CUDA-graph capture, a buffer comes from that graph's memory
    pool and its zero-fill is a node of the graph (a harmless extra memset at each replay).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int, int], _Counters] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device, stream: int, rows: int) -> torch.Tensor:
        """A buffer of at least `rows` zero counters for launches on `stream` of `device`."""
        if not isinstance(device, torch.device):
            raise InputError(f"device must be a torch.device, got {device!r}")
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise InputError(f"stream must be a stream handle (an int >= 0), got {stream!r}")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_COUNTERS:
            raise InputError(f"rows must be an int in 1..{MAX_COUNTERS}, got {rows!r}")
        key = (device.type, -1 if device.index is None else device.index, stream)
        entry = self._entries.get(key)
        if entry is not None and entry.buffer.numel() >= rows:
            return entry.buffer
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.buffer.numel() < rows:
                size = MIN_COUNTERS if entry is None else entry.buffer.numel()
                while size < rows:
                    size = min(2 * size, MAX_COUNTERS)
                fresh = torch.zeros(size, dtype=torch.int32, device=device)  # [capacity]
                if entry is None:
                    entry = self._entries[key] = _Counters(fresh)
                else:
                    entry.retired.append(entry.buffer)
                    entry.buffer = fresh
            return entry.buffer

    def keys(self) -> list[tuple[str, int, int]]:
        return list(self._entries)


COUNTERS = CounterCache()
