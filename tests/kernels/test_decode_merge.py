"""CPU tier for the split-KV merges of the CUDA decode kernel (kernels/decode_merge.py): the
fused-vs-separate rule, the per-stream counter cache, the rendered fused merge (compiled with
NVRTC for sm_90) and the split heuristic's short-context floor. The GPU checks are in
test_decode_gpu.py (`-k merge`)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import extras

import sparsegen
from sparsegen.errors import InputError
from sparsegen.kernels import decode as dec
from sparsegen.kernels import decode_merge as dm
from sparsegen.kernels import decode_template as dt

PHI3 = sparsegen.get_pattern("phi3small")


def test_rule_fused_up_to_the_byte_limit():
    per_split = 4 * 128 * 4  # Phi-3-Small: 4 heads per block x 128 dims x f32
    limit = dm.FUSED_MAX_BYTES // per_split
    assert limit >= 2
    assert dm.use_fused(2, 4, 128) and dm.use_fused(limit, 4, 128)
    assert not dm.use_fused(limit + 1, 4, 128)
    assert not dm.use_fused(1, 4, 128)  # one split: nothing to merge
    # more heads per block or wider heads: fewer splits fit in one block's merge
    assert dm.use_fused(limit // 2, 8, 128) and not dm.use_fused(limit // 2 + 1, 8, 128)
    assert dm.use_fused(2 * limit, 4, 64) and not dm.use_fused(2 * limit + 1, 4, 64)


def test_rule_override():
    assert dm.use_fused(256, 8, 128, "fused")
    assert not dm.use_fused(2, 4, 128, "separate")
    assert not dm.use_fused(1, 4, 128, "fused")  # one split never merges
    assert dm.use_fused(2, 4, 128, None)


@pytest.mark.parametrize(
    "args, match",
    [
        ((2, 4, 128, "fast"), "merge"),
        ((2, 4, 128, True), "merge"),
        ((2, 4, 128, "FUSED"), "merge"),
        ((0, 4, 128), "splits"),
        ((True, 4, 128), "splits"),
        ((2.0, 4, 128), "splits"),
        ((2, 0, 128), "heads_per_block"),
        ((2, 4, -128), "head_dim"),
    ],
)
def test_rule_bad_inputs_are_typed(args, match):
    with pytest.raises(InputError, match=match):
        dm.use_fused(*args)


def test_counter_cache_grows_and_keeps_old_buffers():
    cache = dm.CounterCache()
    cpu = torch.device("cpu")
    a = cache.get(cpu, 7, 10)
    assert a.dtype == torch.int32 and a.numel() == dm.MIN_COUNTERS and not a.any()
    assert cache.get(cpu, 7, dm.MIN_COUNTERS) is a  # fits: the same buffer, no new zero-fill
    a[:3] = 5  # what a kernel would leave if it did not reset (it does); the cache never re-zeros
    assert cache.get(cpu, 7, 1)[0] == 5
    b = cache.get(cpu, 7, dm.MIN_COUNTERS + 1)
    assert b.numel() == 2 * dm.MIN_COUNTERS and not b.any() and b.data_ptr() != a.data_ptr()
    c = cache.get(cpu, 7, 5 * dm.MIN_COUNTERS)
    assert c.numel() == 8 * dm.MIN_COUNTERS
    # grown-out buffers stay alive: a captured CUDA graph may still hold their address
    entry = cache._entries[("cpu", -1, 7)]
    assert entry.retired[0] is a and entry.retired[1] is b and entry.buffer is c
    assert cache.get(cpu, 7, 3) is c  # never shrinks


def test_counter_cache_is_per_stream_and_device():
    cache = dm.CounterCache()
    cpu = torch.device("cpu")
    s1, s2 = cache.get(cpu, 1, 4), cache.get(cpu, 2, 4)
    assert s1.data_ptr() != s2.data_ptr()
    assert cache.get(torch.device("meta"), 1, 4).device.type == "meta"
    assert sorted(cache.keys()) == [("cpu", -1, 1), ("cpu", -1, 2), ("meta", -1, 1)]
    assert cache.get(cpu, 1, 4) is s1


@pytest.mark.parametrize(
    "args, match",
    [
        (("cuda", 0, 4), "device"),
        ((torch.device("cpu"), -1, 4), "stream"),
        ((torch.device("cpu"), 1.5, 4), "stream"),
        ((torch.device("cpu"), True, 4), "stream"),
        ((torch.device("cpu"), 0, 0), "rows"),
        ((torch.device("cpu"), 0, 2**31), "rows"),
        ((torch.device("cpu"), 0, "8"), "rows"),
    ],
)
def test_counter_cache_bad_inputs_are_typed(args, match):
    with pytest.raises(InputError, match=match):
        dm.CounterCache().get(*args)


def test_rendered_fused_merge():
    src = dt.render_source(PHI3.layers[0], "bf16", 16)
    assert "#define REDUCE_WARPS 16" in src
    assert "int* __restrict__ counters) {" in src
    body = src[src.index("static __device__ __forceinline__ void merge_if_last(") :]
    # release before the atomic, acquire after it, L2 reads of the partials, and the reset
    fence, atomic, reset = (
        body.index("__threadfence();"),
        body.index("atomicAdd(counter, 1)"),
        body.index("atomicExch(counter, 0)"),
    )
    assert fence < atomic < reset < body.index("__threadfence();", reset)
    assert "__ldcg(reinterpret_cast<const float4*>" in body and "__ldcg(ml + min(s, num_splits - 1))" in body
    # the split loop's kernel entry is unchanged but for the counters pointer: one launch serves both merges
    assert re.search(r"if \(num_splits > 1 && counters != nullptr\)", src)


@pytest.mark.slow
def test_fused_build_compiles_for_sm90_and_aot_launch_checks_merge():
    """The default kernel (fused merge inside) builds with NVRTC for sm_90; its launcher refuses a
    bad `merge` with a typed error before anything touches a GPU."""
    extras.require("cuda.core")
    kernel = dec.get_decode_kernel(PHI3.layers[0], dtype=torch.bfloat16, arch="sm_90")
    assert kernel.cubin[:4] == b"\x7fELF" and "merge_if_last" in kernel.source
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(InputError, match="merge"):
        kernel.launch(q, cache, cache, tables, lens, 1 / 128, splits=2, merge="both")


def test_split_floor_short_contexts():
    """At least MIN_SPLIT_TOKENS per split: 48 splits at 1 x 8K (the session-6 sweep's best)."""
    assert dec.num_splits(8, 8192, 132) == 48
    assert dec.num_splits(8, 520 * 16, 132) == 48  # an engine table of 8K + 128 tokens
    assert dec.num_splits(8, 4096, 132) == 24
    assert dec.num_splits(8, 16384, 132) == 64  # the wave decides again
    assert dec.num_splits(256, 8192, 132) == 2  # 32 x 8K
    for rows in range(1, 600, 13):
        for ctx in (64, 160, 319, 1000, 8192, 40000):
            s = dec.num_splits(rows, ctx, 132)
            assert s == 1 or s * dec.MIN_SPLIT_TOKENS <= -(-ctx // dec.TILE) * dec.TILE


@pytest.mark.slow
def test_build_without_the_fused_merge():
    """fused_merge=0 renders the kernel without the merge's code (a benchmark baseline); its
    launcher then uses the separate merge, and refuses an explicit merge="fused"."""
    extras.require("cuda.core")
    layer = PHI3.layers[1]
    src = dt.render_source(layer, "bf16", 16, fused_merge=0)
    assert "#define FUSED_MERGE 0" in src and "#define FUSED_MERGE 1" in dt.render_source(layer, "bf16", 16)
    kernel = dec.get_decode_kernel(
        layer, dtype=torch.bfloat16, page_size=16, arch="sm_90", knobs={"fused_merge": 0}
    )
    assert not kernel.fused_merge and kernel.cubin[:4] == b"\x7fELF"
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(InputError, match="without the fused merge"):
        kernel.launch(q, cache, cache, tables, lens, 1 / 128, splits=2, merge="fused")
