"""Decode steps captured as CUDA graphs, one per (padded batch size, block-table width).

Each graph reads its inputs from static buffers sized for `max_num_seqs` and the model's
longest context. A step builds the rows on the host, the real ones and a harmless padding row
for the rest (token 0 at position 0, writing into the cache's scratch page, reading only that
page), copies them in with three non-blocking host-to-device copies from pinned memory
(ids/positions/slots, seq_lens, block tables; a fourth for LongRoPE flags), replays, and returns
the real rows' logits. A lookahead step (`runner.inflight`) takes its ids from the previous
step's sampled tokens instead, by a device-to-device copy after the host rows. The host copy
of the block tables is kept across steps and only the pages added since are written into it
(a row whose sequence or `page_epoch` changed is rewritten whole).

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
from .decode_inputs import DecodeInputs
from .graph_capture import capture
from .kv_cache import KVCache, pages_for
from .transfer import copy_in

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
        self.i64 = torch.zeros((3, n), dtype=torch.long, device=dev)  # rows: ids, positions, slots
        self.ids, self.positions, self.slots = self.i64[0], self.i64[1], self.i64[2]  # [B] each
        self.use_long = torch.zeros(n, dtype=torch.bool, device=dev)  # [B]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)  # [B]
        self.block_tables = torch.full(
            (n, width), cache.scratch_page, dtype=torch.int32, device=dev
        )  # [B, max_pages]
        # The block tables on the host, kept across steps: a row is rewritten only from where
        # its sequence's table has grown (a page every page_size steps), or whole when the row
        # holds another sequence or a replaced table. Rebuilding 32 rows of an 8K context from
        # Python lists took ~1.4 ms a step on the CPU (the GPU waited for it while steps were synchronous).
        self.host_tables = torch.full((n, width), cache.scratch_page, dtype=torch.int32)  # [B, max_pages]
        self._host_np = self.host_tables.numpy()
        self._row_keys: list[tuple[int, int, int] | None] = [None] * n  # (seq_id, page_epoch, pages written)
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
        with capture(graph, pool=self.pool):  # no garbage collection mid-capture
            logits = self.forward(self.ids[:b], batch, layers)  # [b, vocab]
        self.pool = graph.pool()
        return graph, logits

    def _update_host_tables(self, inputs: DecodeInputs, b: int) -> None:
        """Rows 0..n-1 of `host_tables` hold the inputs' block tables padded with the scratch
        page, rows n..b-1 only the scratch page (a padding row reads nothing else)."""
        table, scratch = self._host_np, self.cache.scratch_page  # [max_pages, ...] numpy view
        n = len(inputs.pages)
        for i in range(b):
            if i >= n:
                if self._row_keys[i] is not None:
                    table[i] = scratch
                    self._row_keys[i] = None
                continue
            pages, (seq_id, epoch) = inputs.pages[i], inputs.keys[i]
            known = self._row_keys[i]
            start = known[2] if known is not None and known[:2] == (seq_id, epoch) else None
            if start is None or start > len(pages):  # another sequence (or table): the whole row
                table[i] = scratch
                start = 0
            if len(pages) > start:
                table[i, start : len(pages)] = pages[start:]
            self._row_keys[i] = (seq_id, epoch, len(pages))

    def run(self, inputs: DecodeInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the step's graph; returns [n, vocab] float32 logits (a copy: the graph's output
        buffer is rewritten by the next replay). `input_ids` ([n] int64 on the device: the
        previous step's sampled tokens) replace `inputs.ids`, copied device to device after the
        host rows, on the same stream."""
        n = len(inputs.ids)
        b = next(s for s in self.sizes if s >= n)
        w = width_bucket(inputs.width, self.max_pages)
        pad = b - n
        scratch, ps = self.cache.scratch_page, self.cache.page_size
        rows = torch.tensor(
            [inputs.ids + [0] * pad, inputs.positions + [0] * pad, inputs.slots + [scratch * ps] * pad],
            dtype=torch.long,
        )  # [3, b] on the host
        copy_in(self.i64[:, :b], rows)
        if input_ids is not None:
            self.ids[:n].copy_(input_ids)
        copy_in(self.seq_lens[:b], torch.tensor(inputs.seq_lens + [1] * pad, dtype=torch.int32))
        self._update_host_tables(inputs, b)
        # host_tables[:b, :w] is a strided view of the kept table: pin a contiguous copy of it
        copy_in(self.block_tables[:b, :w], self.host_tables[:b, :w].contiguous())
        if self.has_long_rope:
            flags = inputs.use_long if inputs.use_long is not None else [False] * n
            copy_in(self.use_long[:b], torch.tensor(flags + [False] * pad, dtype=torch.bool))
        if (b, w) not in self.graphs:
            self.graphs[b, w] = self._capture(b, w)
        graph, logits = self.graphs[b, w]
        graph.replay()
        return logits[:n].clone()
