"""Shared benchmark pieces: timing, the ceilings measured in the same run, and baselines.

Every ratio a benchmark prints compares numbers from one process on one GPU: sparsegen's
kernel, dense SDPA, FlexAttention with a block mask built from the same spec, and the copy
bandwidth / matmul rate measured right before.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from ..spec import LayerSpec


def median_ms(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of fn() in milliseconds, with CUDA events (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def median_ms_graph(fn, *, rep_ms: int = 100) -> tuple[float, bool]:
    """Median of CUDA-graph replays of fn() (no launch gaps), or plain timing if capture fails.

    Returns (ms, captured)."""
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")), True
    except Exception:  # noqa: BLE001 - a kernel that cannot be captured is still timed
        torch.cuda.synchronize()
        return median_ms(fn, rep_ms=rep_ms), False


@dataclass(frozen=True)
class Ceilings:
    copy_tb_s: float  # device-to-device copy, bytes read + written per second / 1e12
    matmul_tflop_s: float  # bf16 8192^3 matmul on random data

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def measure_ceilings() -> Ceilings:
    """Copy bandwidth (2 GiB buffers, far above L2) and the bf16 matmul rate, measured now."""
    n = 1 << 30  # elements of bf16: 2 GiB per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e12
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b)
    return Ceilings(copy_tb_s=copy, matmul_tflop_s=2 * m**3 / (mm_ms * 1e-3) / 1e12)


def flex_mask_mod(layer: LayerSpec, n_q: int, n_k: int, device):
    """A FlexAttention mask_mod equal to DESIGN §1 (queries are the last n_q of n_k positions).

    Fields shared by every head become Python constants, so FlexAttention's generated kernel
    does plain integer arithmetic; only fields that differ per head are looked up by head index.
    """
    names = ("block_size", "local_blocks", "vert_stride", "vert_offset", "sliding_window", "dense")
    per_head = {}
    for name in names:
        values = [int(getattr(h, name)) for h in layer.heads]
        per_head[name] = values[0] if len(set(values)) == 1 else torch.tensor(values, device=device)
    shift = n_k - n_q

    def field(name, h):
        value = per_head[name]
        return value[h] if isinstance(value, torch.Tensor) else value

    def mask_mod(b, h, q_idx, kv_idx):
        i, j = q_idx + shift, kv_idx
        causal = j <= i
        dense = field("dense", h)
        if isinstance(dense, int) and dense:
            return causal
        bs = field("block_size", h)
        seen = (i - j) < field("sliding_window", h)
        local = field("local_blocks", h)
        if not isinstance(local, int) or local:
            seen = seen | ((i // bs - j // bs) < local)
        stride = field("vert_stride", h)
        if not isinstance(stride, int):
            seen = seen | (
                (stride > 0) & ((j // bs + field("vert_offset", h) + 1) % stride.clamp(min=1) == 0)
            )
        elif stride:
            seen = seen | ((j // bs + field("vert_offset", h) + 1) % stride == 0)
        if not isinstance(dense, int):
            seen = seen | (dense > 0)
        return causal & seen

    return mask_mod


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width table (numbers get 3 significant decimals)."""

    def cell(x) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    cells = [[cell(x) for x in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
