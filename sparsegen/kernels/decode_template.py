"""What the CUDA paged-decode template receives for a layer spec, and the rendered source.

A block of the kernel serves one head group (up to 8 query heads of one KV head); groups whose
heads share a pattern share one rendered `Pattern<C>` class. Every value handed to the template
is an int, a bool or an allowed word (sparsegen.jit.render checks), never a free string.
"""

from __future__ import annotations

import math
import struct

from .. import dtypes
from ..errors import InputError
from ..jit.render import render
from ..spec import HeadSpec, LayerSpec
from .naming import pattern_name

TEMPLATE = "paged_decode.cu.jinja"
SOURCE_FILE = "kernel.cu"
KERNEL = "sparsegen_paged_decode"  # the kernels' extern "C" names, rendered into the template
REDUCE = "sparsegen_paged_decode_reduce"
TILE = 64  # tokens per split unit (CHUNK in the template, rendered from here)
MAX_SPLITS = 256  # most splits of one sequence (the reduce kernel's bound, rendered from here)
REDUCE_WARPS = 16  # most warps of a reduce-kernel block (the launcher uses min(this, splits))
MAX_HEADS_PER_BLOCK = 8
PAGE_SIZES = range(8, 129)  # tokens per KV-cache page the kernel supports
HEAD_DIMS = tuple(range(32, 257, 16))  # every multiple of 16 from 32 to 256
FEATURES = frozenset({"sink_tokens", "logit_softcap", "learned_sinks"})  # LayerSpec.features it implements
# Template knobs (ints): PIPE issues the next warp tile's K/V loads before this tile's math;
# MIN_BLOCKS is __launch_bounds__'s blocks-per-SM hint (a register cap); Q_SMEM keeps q's mma
# fragments in shared memory instead of 32 registers. The default (no pipelining, q in registers,
# 128 registers -> 4 blocks = 16 warps per SM) was the fastest of the variants measured on an
# H200 at every shape (benchmarks/decode/NOTES.md): occupancy beat the pipelined build's
# 12 warps per SM even though each of those keeps twice the bytes in flight. FUSED_MERGE
# compiles the in-kernel split merge (decode_merge); 0 gives the kernel as it was before that
# merge existed, so a benchmark can check that the merge's code costs the other paths nothing.
# merge_trigger: the separate merge kernel lets a PDL-launched kernel after it (the batch-1 O
# GEMV, kernels.linear.gemv) start at once, so its first weight tile loads during the merge.
# qk_accs: the QK product's k-steps go into this many independent accumulators (1, 2 or 4), so
# each tile's serial chain of QK mma is KSTEPS / qk_accs long; 2 (the default)
# measured 3.7 % faster on the dense layer at 32-64 x 8K and up to 1.6 % on the sparse one,
# 4 spilled and lost (benchmarks/decode/NOTES.md).
DEFAULT_KNOBS = {
    "pipeline": 0,
    "min_blocks": 4,
    "q_smem": 0,
    "fused_merge": 1,
    "merge_trigger": 1,
    "qk_accs": 2,
}


def default_knobs(head_dim: int) -> dict:
    """DEFAULT_KNOBS, with the register cap of head dims above 128: q, one tile's K and V and the
    fp32 output accumulators take about head_dim * 5 / 8 registers per lane, past the 128 that 4
    blocks per SM allow (ptxas: tests/kernels/test_decode_features_aot.py checks no spills)."""
    if head_dim <= 128:
        return dict(DEFAULT_KNOBS)
    return {**DEFAULT_KNOBS, "min_blocks": 3 if head_dim <= 192 else 2}


def heads_per_block(layer: LayerSpec) -> int:
    """The query heads one block serves: the whole GQA group, or its largest divisor <= 8."""
    g = layer.group_size
    return max(d for d in range(1, min(g, MAX_HEADS_PER_BLOCK) + 1) if g % d == 0)


def _head_constants(head: HeadSpec) -> dict:
    return {
        "dense": head.dense,
        "bs_shift": int(math.log2(head.block_size)),
        "local": head.local_blocks,
        "stride": head.vert_stride,
        "offset": head.vert_offset,
        "window": head.sliding_window,
        "sinks": head.sink_tokens,
    }


def _f32_bits(x: float) -> int:
    """The float32 bit pattern of x, as an int (the template spells it __int_as_float(bits))."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


FAR_SCALE = 16  # a chunk's weight when every token of it is needed (the near range)


def split_weights(heads: tuple[HeadSpec, ...]) -> tuple[int, int]:
    """(near_chunks, far_weight) for one head group, so that splits can share work evenly.

    The last `near_chunks` TILE-token chunks before the query hold the local blocks / window,
    which some head of the group needs in full: each weighs FAR_SCALE. An earlier chunk weighs
    `far_weight` (1..FAR_SCALE): the share of those chunks that some head needs (vertical
    stride blocks), since the kernel skips the others without loading them.
    """
    if any(h.dense for h in heads):
        return 0, FAR_SCALE
    near = max(max(h.local_blocks * h.block_size + h.block_size if h.local_blocks else 0, h.sliding_window)
               for h in heads)  # fmt: skip
    period = 1024  # chunks sampled: the exact share for strides x block sizes dividing 1024 x TILE
    needed = 0
    for c in range(period):
        first_block = {h: (c * TILE) // h.block_size for h in heads}
        last_block = {h: (c * TILE + TILE - 1) // h.block_size for h in heads}
        needed += any(
            h.vert_stride
            and any(
                (blk + h.vert_offset + 1) % h.vert_stride == 0
                for blk in range(first_block[h], last_block[h] + 1)
            )
            for h in heads
        )
    far = min(FAR_SCALE, max(1, round(FAR_SCALE * needed / period)))
    return -(-near // TILE) + 1, far


def _qk_accs(value: int) -> int:
    if isinstance(value, bool) or value not in (1, 2, 4):
        raise InputError(f"decode template knob qk_accs must be 1, 2 or 4, got {value!r}")
    return int(value)


KV_FP8 = {"fp8e4m3": "e4m3", "fp8e5m2": "e5m2"}  # fp8 KV dtype names (dtypes.FP8_NAMES) -> cvt format
FP8_MIN_ARCH = 89  # the cvt of fp8 pairs to fp16 the fp8 template uses exists from sm_89 on


def check_kv_dtype(kv_dtype: object) -> str:
    """'' (K/V of q's dtype) or an fp8 name of KV_FP8; InputError otherwise."""
    if kv_dtype is None or kv_dtype == "":
        return ""
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_FP8:
        raise InputError(
            f"the decode kernels' kv_dtype must be None or one of {sorted(KV_FP8)}, got {kv_dtype!r}"
        )
    return kv_dtype


def template_constants(layer: LayerSpec, dtype_name: str, page_size: int, *, kv_dtype: str = "",
                       **knobs: int) -> dict:  # fmt: skip
    """Everything the template receives: ints, bools and allowed words only. `kv_dtype` ('' or
    an fp8 name of KV_FP8) is the cache's element type when it is not q's."""
    kv_dtype = check_kv_dtype(kv_dtype)
    unknown = set(knobs) - set(DEFAULT_KNOBS)
    if unknown:
        raise InputError(f"unknown decode template knobs {sorted(unknown)}")
    knobs = {**default_knobs(layer.head_dim), **knobs}
    ctype = dtypes.resolve(dtype_name, kernel=True).ctype
    hpb = heads_per_block(layer)
    classes: list[tuple[HeadSpec, ...]] = []
    group_class = []
    for g in range(layer.num_heads // hpb):
        heads = layer.heads[g * hpb : (g + 1) * hpb]
        if heads not in classes:
            classes.append(heads)
        group_class.append(classes.index(heads))
    return {
        "dtype": dtype_name,
        "ctype": ctype,
        "head_dim": layer.head_dim,
        "page_size": page_size,
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "group_size": layer.group_size,
        "heads_per_block": hpb,
        "pipeline": int(knobs["pipeline"]),
        "min_blocks": int(knobs["min_blocks"]),
        "q_smem": int(knobs["q_smem"]),
        "fused_merge": int(bool(knobs["fused_merge"])),
        "merge_trigger": int(bool(knobs["merge_trigger"])),
        "qk_accs": _qk_accs(knobs["qk_accs"]),
        "classes": [[_head_constants(h) for h in cls] for cls in classes],
        "class_splits": [list(split_weights(cls)) for cls in classes],
        "far_scale": FAR_SCALE,
        "group_class": group_class,
        "tile": TILE,
        "max_splits": MAX_SPLITS,
        "reduce_warps": REDUCE_WARPS,
        "tail16": bool(layer.head_dim % 32),
        "softcap": bool(layer.logit_softcap),
        "softcap_bits": _f32_bits(layer.logit_softcap * math.log2(math.e)) if layer.logit_softcap else 0,
        "softcap_inv_bits": _f32_bits(1.0 / (layer.logit_softcap * math.log2(math.e)))
        if layer.logit_softcap
        else 0,
        "learned_sinks": bool(layer.learned_sinks),
        "fp8": bool(kv_dtype),
        "fp8_e5m2": KV_FP8.get(kv_dtype) == "e5m2",
        "kernel_fn": KERNEL,
        "reduce_fn": REDUCE,
    }


def render_source(
    layer: LayerSpec, dtype_name: str, page_size: int, *, kv_dtype: str = "", **knobs: int
) -> str:
    return render(TEMPLATE, **template_constants(layer, dtype_name, page_size, kv_dtype=kv_dtype, **knobs))


def kernel_name(layer: LayerSpec, dtype_name: str, page_size: int, kv_dtype: str = "") -> str:
    """Readable half of the key: decode_bf16_hd128_ps16_g4_bs64_l16_v8, with an fp8 cache
    decode_bf16_kvfp8e4m3_hd128_...; every head group of a hybrid layer is spelled
    (naming.pattern_name)."""
    kv = f"_kv{check_kv_dtype(kv_dtype)}" if kv_dtype else ""
    return (f"decode_{dtype_name}{kv}_hd{layer.head_dim}_ps{page_size}_g{layer.group_size}_"
            f"{pattern_name(layer)}")  # fmt: skip
