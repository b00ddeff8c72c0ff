"""One decode step's inputs on the host (`DecodeInputs`), and the block tables padded with the
scratch page: what the model runner builds for a decode step and the CUDA graphs copy in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.batch import ForwardBatch
from .transfer import to_device


def padded_tables(pages: list[list[int]], scratch: int, width: int | None = None) -> np.ndarray:
    """Block tables as one [len(pages), width] int32 array, each row padded with the scratch page
    to `width` (default: the longest)."""
    width = max((len(p) for p in pages), default=0) if width is None else width
    tables = np.full((len(pages), width), scratch, dtype=np.int32)
    for row, p in enumerate(pages):
        tables[row, : len(p)] = p
    return tables


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step, one row per sequence, on the host."""

    ids: list[int]  # the newest token of each sequence
    positions: list[int]  # its position
    slots: list[int]  # its flat cache slot
    seq_lens: list[int]  # tokens including it
    pages: list[list[int]]  # each sequence's block table (its own list: read, never changed here)
    keys: list[tuple[int, int]]  # (seq_id, page_epoch) per row: which block table each row holds
    width: int  # the longest block table
    scratch: int  # the scratch page, which pads the tables
    use_long: list[bool] | None  # LongRoPE long factors per row; None without LongRoPE

    def to_batch(
        self, device: torch.device, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """The step as tensors on `device`; `input_ids` ([B] int64, on `device`) replaces `ids`."""

        def t(x, dtype=torch.long):
            return to_device(torch.tensor(x, dtype=dtype), device)

        tables = padded_tables(self.pages, self.scratch, self.width)  # [B, width]
        batch = ForwardBatch(
            is_decode=True,
            positions=t(self.positions),  # [B]
            use_long_rope=t(self.use_long, torch.bool) if self.use_long is not None else None,  # [B]
            slot_mapping=t(self.slots),  # [B]
            block_tables=t(tables, torch.int32),  # [B, width]
            seq_lens=t(self.seq_lens, torch.int32),  # [B]
        )
        return (t(self.ids) if input_ids is None else input_ids), batch  # ids: [B]
