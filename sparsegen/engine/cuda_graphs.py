"""Decode steps captured as CUDA graphs, one per (padded batch size, block-table width).

Each graph reads its inputs from static buffers sized for `max_num_seqs` and the model's
longest context. A step copies the real rows in, pads the rest with a harmless row (token 0 at
position 0, writing into the cache's scratch page, reading only that page), replays, and
returns the real rows' logits.

The block-table width is bucketed to a power of two of pages, not fixed at the longest
context: the decode kernel sizes its split-KV grid from that width, so an 8K context must not
be launched as if it were 128K. Graphs are captured lazily, on the first decode of each
bucket, after one eager warm-up run (which also compiles the kernels) on a side stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models.batch import ForwardBatch
from ..models.phi3small import Phi3SmallForCausalLM
from .kv_cache import KVCache, pages_for

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH_PAGES = 64


def width_bucket(pages: int, max_pages: int) -> int:
    """The smallest power of two >= pages (at least MIN_WIDTH_PAGES), capped at max_pages."""
    width = MIN_WIDTH_PAGES
    while width < pages:
        width *= 2
    return min(width, max_pages)


class DecodeGraphs:
    def __init__(
        self,
        model: Phi3SmallForCausalLM,
        cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        forward: Callable[..., torch.Tensor] | None = None,
    ):
        """`forward` (default: the model itself) is what each graph captures, e.g. the model
        under torch.compile."""
        self.model, self.cache = model, cache
        self.forward = forward if forward is not None else model
        dev = model.device
        self.sizes = [b for b in BATCH_SIZES if b < max_num_seqs] + [max_num_seqs]
        n, width = max_num_seqs, pages_for(max_model_len, cache.page_size)
        scratch = cache.scratch_page
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # [B]
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)  # [B]
        self.use_long = torch.zeros(n, dtype=torch.bool, device=dev)  # [B]
        self.slots = torch.full((n,), scratch * cache.page_size, dtype=torch.long, device=dev)  # [B]
        self.block_tables = torch.full((n, width), scratch, dtype=torch.int32, device=dev)  # [B, max_pages]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)  # [B]
        self.has_long_rope = model.config.rope_scaling is not None
        self.max_pages = width
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def _batch(self, b: int, w: int) -> ForwardBatch:
        return ForwardBatch(
            is_decode=True,
            positions=self.positions[:b],
            use_long_rope=self.use_long[:b] if self.has_long_rope else None,
            slot_mapping=self.slots[:b],
            block_tables=self.block_tables[:b, :w],  # rows keep the full stride; columns are contiguous
            seq_lens=self.seq_lens[:b],
        )

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch, layers = self._batch(b, w), self.cache.layers
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(self.ids[:b], batch, layers)  # warm-up: compiles kernels, settles allocations
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(self.ids[:b], batch, layers)  # [b, vocab]
        self.pool = graph.pool()
        return graph, logits

    def _reset_padding(self) -> None:
        scratch = self.cache.scratch_page
        self.ids.zero_()
        self.positions.zero_()
        self.use_long.zero_()
        self.slots.fill_(scratch * self.cache.page_size)
        self.block_tables.fill_(scratch)
        self.seq_lens.fill_(1)

    def run(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # [B, vocab] float32
        n = ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        w = width_bucket(batch.block_tables.shape[1], self.max_pages)
        self._reset_padding()
        self.ids[:n] = ids
        self.positions[:n] = batch.positions
        if batch.use_long_rope is not None:
            self.use_long[:n] = batch.use_long_rope
        self.slots[:n] = batch.slot_mapping
        self.block_tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
        self.seq_lens[:n] = batch.seq_lens
        if (b, w) not in self.graphs:
            self.graphs[b, w] = self._capture(b, w)
        graph, logits = self.graphs[b, w]
        graph.replay()
        return logits[:n].clone()
