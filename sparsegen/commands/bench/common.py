"""Shared benchmark pieces: timing, the ceilings measured in the same run, and baselines.

Every ratio a benchmark prints compares numbers from one process on one GPU: sparsegen's
kernel, dense SDPA, FlexAttention with a block mask built from the same spec, and the copy
bandwidth / matmul rate measured right before.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from ...runner.graph_capture import capture


def median_ms(fn, *, warmup_ms: int = 25, rep_ms: int = 100, min_reps: int = 10) -> float:
    """Median time of fn() in milliseconds, with CUDA events (triton.testing.do_bench), over at
    least `min_reps` timed calls: do_bench sizes its repeats to `rep_ms`, which for a 45 ms kernel
    would be 2 calls, so long cases get a longer budget (min_reps x a first estimate)."""
    from triton.testing import do_bench

    estimate = float(do_bench(fn, warmup=1, rep=1, return_mode="median"))  # a handful of calls
    rep = max(rep_ms, min_reps * estimate)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep, return_mode="median"))


def median_ms_graph(fn, *, rep_ms: int = 100) -> tuple[float, bool]:
    """Median of CUDA-graph replays of fn() (no launch gaps), or plain timing if capture fails.

    Returns (ms, captured)."""
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")), True
    except Exception:  # noqa: BLE001 - a kernel that cannot be captured is still timed
        torch.cuda.synchronize()
        return median_ms(fn, rep_ms=rep_ms), False


def graph_us(fn, *, calls: int = 20, replays: int = 10) -> float:
    """Median microseconds per call of fn(i), i = 0 .. calls - 1, from replays of one CUDA graph
    that holds all `calls` calls: no launch gaps, so a ~10 us kernel is timed rather than the
    host's launch cost. fn(i) may pick rotating inputs by i; it runs once per i on a side stream
    first (allocations and lazy initialisation stay out of the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


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
