"""Warm the GPU's L2 with a weight matrix before the kernel that reads it: Hopper's bulk prefetch.

A batch-1 decode step is the weights read once, but between the linear layers run kernels that
leave the memory bus idle: rotary, the paged decode (latency-bound at batch 1: ~17 us a layer
against 4-8 us of reads), the norms, GeGeLU. One short kernel launched before them issues
`cp.async.bulk.prefetch.L2` for the next linear's weight (or its first megabytes): each thread
hands one CHUNK-byte range to the copy engine and exits, without waiting, so the weight streams
into L2 while the latency-bound kernels run, and the GEMV that follows reads it from L2.

Only a hint: nothing is written, no result depends on it, and a prefetched line that is evicted
first is just read again. `models.options.L2Prefetch` says what is prefetched where; the model
calls `prefetch` on decode steps on a GPU (sm_90 and newer) only. Imported only there: a
@triton.jit kernel is bound to Triton's interpreter, or not, when it is defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import InputError

CHUNK = 16384  # bytes per bulk prefetch (a multiple of 16)
PER_PROGRAM = 32  # prefetches per program: one warp, one per lane
MIN_CAPABILITY = (9, 0)  # cp.async.bulk needs sm_90


@triton.jit
def _l2_prefetch_kernel(
    BASE, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, EVICT_LAST: tl.constexpr
):
    # BASE: the first byte of the range ([nbytes] uint8, 16-byte aligned, nbytes % 16 == 0).
    # Lane j of program p prefetches bytes [c * CHUNK, (c + 1) * CHUNK) for c = p * PER_PROGRAM + j,
    # cut at nbytes; a lane past the end issues nothing.
    c = tl.program_id(0).to(tl.int64) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    off = c * CHUNK
    size = tl.where(off < nbytes, tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
    ptr = BASE + off
    if EVICT_LAST:  # the lines are kept over normally cached ones until read
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptr, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
            "mov.u32 $0, 0; }",
            "=r,l,r",
            [ptr, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def supported(t: torch.Tensor) -> bool:
    """A CUDA tensor on an sm_90+ device (where the bulk prefetch exists)."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= MIN_CAPABILITY


def prefetch(
    t: torch.Tensor, nbytes: int | None = None, evict_last: bool = False, chunk: int = CHUNK
) -> None:
    """Start bringing the first `nbytes` of contiguous `t` (all of it by default) into L2, on the
    current stream; returns as soon as the prefetches are issued. Bytes past a 16-byte multiple
    are left out (the instruction moves 16-byte units)."""
    if not isinstance(t, torch.Tensor) or not supported(t):
        raise InputError("l2_prefetch.prefetch needs a CUDA tensor on an sm_90 or newer GPU")
    if not t.is_contiguous():
        raise InputError("l2_prefetch.prefetch needs a contiguous tensor")
    if chunk <= 0 or chunk % 16:
        raise InputError(f"the prefetch chunk must be a positive multiple of 16 bytes, got {chunk}")
    total = t.numel() * t.element_size()
    n = total if nbytes is None else min(int(nbytes), total)
    if t.data_ptr() % 16:
        raise InputError("l2_prefetch.prefetch needs a 16-byte aligned tensor")
    n -= n % 16
    if n <= 0:
        return
    base = t.view(-1).view(torch.uint8)  # [total] bytes
    grid = (triton.cdiv(triton.cdiv(n, chunk), PER_PROGRAM),)
    _l2_prefetch_kernel[grid](
        base, n, CHUNK=chunk, PER_PROGRAM=PER_PROGRAM, EVICT_LAST=evict_last, num_warps=1
    )
