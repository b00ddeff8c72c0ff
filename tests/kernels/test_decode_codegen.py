"""CPU tier for the CUDA decode kernel: rendering, keys, and NVRTC compiles for sm_80 / sm_90.

No GPU is needed: NVRTC compiles for an explicit arch. The GPU tier is test_decode_gpu.py.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from helpers import extras
from helpers.ptxas import ptxas_report
from helpers.specs import eight_class_hybrid_layer
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import CompileError, InputError
from sparsegen.jit import nvrtc_build as nb
from sparsegen.jit import render
from sparsegen.kernels import decode as dec
from sparsegen.kernels import decode_template as dt
from sparsegen.testing import layer_specs

extras.require("cuda.core")

PHI3 = sparsegen.get_pattern("phi3small").layers[0]


def test_render_phi3small_snapshot():
    src = dt.render_source(PHI3, "bf16", 16)
    assert "typedef __nv_bfloat16 elem_t;" in src
    assert "#define HEAD_DIM 128" in src and "#define PAGE_SIZE 16" in src and "#define HPB 4" in src
    # Heads h and h+8 share a pattern: 8 head groups of 4, but only 2 distinct pattern structs.
    assert len(re.findall(r"template <> struct Pattern<\d+>", src)) == 2
    assert re.findall(r"case (\d+): decode_group<(\d+)>", src) == [(str(g), str(g % 2)) for g in range(8)]
    # All pattern numbers are literals: block 64 -> shift 6, 16 local blocks, stride 8.
    assert "((i >> 6) - (j >> 6)) < 16" in src
    assert "(((j >> 6) + 1) % 8) == 0" in src  # head 0: offset 0
    assert "(((j >> 6) + 8) % 8) == 0" in src  # head 7: offset 7
    assert "{{" not in src and "{%" not in src


def test_render_is_deterministic_and_dtype_specific():
    a = dt.render_source(PHI3, "fp16", 32)
    assert a == dt.render_source(PHI3, "fp16", 32)
    assert "typedef __half elem_t;" in a and "__half2 elem2_t" in a
    assert a != dt.render_source(PHI3, "bf16", 32)


def test_render_hybrid_window_dense():
    layer = LayerSpec(
        4, 1, 96,
        (HeadSpec(dense=True), HeadSpec(block_size=16, sliding_window=100), HeadSpec(block_size=32, local_blocks=3),
         HeadSpec(block_size=16, vert_stride=4, vert_offset=2, sliding_window=7)),
    )  # fmt: skip
    src = dt.render_source(layer, "fp16", 8)
    assert "m |= 1u << 0;" in src  # dense head: always visible
    assert "(i - j) < 100" in src and "(i - j) < 7" in src
    assert "#define HEAD_DIM 96" in src and "#define KSTEPS (HEAD_DIM / 16)" in src
    assert "#define VTAIL ((HEAD_DIM % 64) / 32)" in src  # the 32-dim tail of a 96-dim V row
    assert "mma.sync.aligned.m16n8k16.row.col.f32." in src and '#define MMA_T "f16"' in src
    # every head group of a hybrid layer is spelled, not only the first head
    assert (
        dt.kernel_name(layer, "fp16", 8)
        == "decode_fp16_hd96_ps8_g4_1xdense__1xbs16_w100__1xbs32_l3__1xbs16_v4_w7"
    )


def test_template_knobs():
    base = dt.render_source(PHI3, "bf16", 16)
    for name, value in dt.DEFAULT_KNOBS.items():
        assert (
            f"#define {dict(pipeline='PIPE', min_blocks='MIN_BLOCKS', q_smem='Q_SMEM', fused_merge='FUSED_MERGE', merge_trigger='MERGE_TRIGGER', qk_accs='QK_ACCS')[name]} {value}"
            in base
        )
    other = dt.render_source(PHI3, "bf16", 16, pipeline=1, min_blocks=3, q_smem=1, merge_trigger=0)
    assert "#define PIPE 1" in other and "#define Q_SMEM 1" in other and "#define MIN_BLOCKS 3" in other
    assert "#define MERGE_TRIGGER 0" in other
    assert "#define QK_ACCS 1" in dt.render_source(PHI3, "bf16", 16, qk_accs=1)
    with pytest.raises(InputError, match="knobs"):
        dt.render_source(PHI3, "bf16", 16, unroll=2)
    for bad in (0, 3, 8, "2"):
        with pytest.raises(InputError, match="qk_accs"):
            dt.render_source(PHI3, "bf16", 16, qk_accs=bad)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_phi3small_kernel_fits_registers_without_spills(arch):
    """The default build of the Phi-3-Small kernel keeps 4 blocks (16 warps) per SM, i.e. at most
    128 registers, and never spills to local memory (benchmarks/decode/NOTES.md has the counts)."""
    report = ptxas_report(dt.render_source(PHI3, "bf16", 16), arch)
    main = report[report.index("entry function 'sparsegen_paged_decode'") :]
    regs = int(re.search(r"Used (\d+) registers", main).group(1))
    assert regs <= 128, main
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in main, main


def test_many_pattern_classes_compile():
    """Shared memory is declared once per kernel, not once per pattern class: a hybrid layer
    whose 8 head groups all differ still fits the 48 KB static limit."""
    layer = eight_class_hybrid_layer()
    src = dt.render_source(layer, "bf16", 16)
    assert len(re.findall(r"template <> struct Pattern<\d+>", src)) == 8
    cubin, _ = nb.compile_cubin(src, "sm_90", name="classes.cu")
    assert cubin[:4] == b"\x7fELF"


def test_heads_per_block():
    mk = lambda h, kv: LayerSpec(h, kv, 64, (HeadSpec(dense=True),) * h)  # noqa: E731
    assert dt.heads_per_block(mk(32, 8)) == 4
    assert dt.heads_per_block(mk(8, 8)) == 1
    assert dt.heads_per_block(mk(32, 1)) == 8
    assert dt.heads_per_block(mk(12, 1)) == 6


def test_num_splits_heuristic():
    # The H200 sweep's choices (benchmarks/decode/NOTES.md): about one resident wave of blocks.
    assert dec.num_splits(8, 128 * 1024, 132) == 64  # batch 1 at 128K: 512 blocks, 4 per SM
    assert dec.num_splits(8, 8192, 132) == 48  # batch 1 at 8K: 160 tokens per split at least, not a wave
    assert dec.num_splits(8, 4096, 132) == 24  # 64 chunks: at least 2.5 per split
    assert dec.num_splits(64, 32 * 1024, 132) == 8
    assert dec.num_splits(512, 8192, 132) == 1
    assert dec.num_splits(8, 64, 132) == 1  # one chunk: nothing to split
    assert dec.num_splits(1, 10**7, 132) == dec.MAX_SPLITS
    nice = {1 << k for k in range(9)} | {3 << k for k in range(7)}
    for rows in range(1, 600, 7):
        for ctx in (64, 1000, 8192, 40000, 131072):
            s = dec.num_splits(rows, ctx, 132)
            assert s in nice and 1 <= s <= dec.MAX_SPLITS and (s == 1 or s <= -(-ctx // 64) // 2)


def test_split_weights():
    """Splits share work: the near range weighs FAR_SCALE per chunk, far chunks their needed share."""
    groups = [PHI3.heads[g * 4 : (g + 1) * 4] for g in range(8)]
    # 16 local blocks of 64 (+ the partial one) = 17 chunks, +1; 4 heads x 1/8 of the far blocks.
    assert {dt.split_weights(g) for g in groups} == {(18, 8)}
    assert dt.split_weights((HeadSpec(dense=True),)) == (0, dt.FAR_SCALE)
    assert dt.split_weights((HeadSpec(block_size=64, sliding_window=4096),)) == (65, 1)  # far: skipped
    one = (
        HeadSpec(block_size=16, local_blocks=2, vert_stride=2),
    )  # every 64-token chunk has a vertical block
    assert dt.split_weights(one) == (2, dt.FAR_SCALE)
    consts = dt.template_constants(PHI3, "bf16", 16)
    assert consts["class_splits"] == [[18, 8], [18, 8]]


def test_context_limit_is_an_input_error():
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    tables = torch.zeros(1, dec.MAX_CONTEXT // 16 + 1, dtype=torch.int32)
    with pytest.raises(InputError, match="at most 8388608 tokens"):
        dec.check_kernel_inputs(q, cache, cache, tables, torch.ones(1, dtype=torch.int32))


def test_template_rejects_free_strings():
    with pytest.raises(CompileError):
        render.render(dt.TEMPLATE, **{**dt.template_constants(PHI3, "bf16", 16), "ctype": "int; evil"})


def test_bad_arguments():
    with pytest.raises(InputError, match="page_size"):
        dec.get_decode_kernel(PHI3, dtype=torch.float16, arch="sm_90", page_size=4)
    with pytest.raises(InputError, match="dtype"):
        dec.get_decode_kernel(PHI3, dtype=torch.float32, arch="sm_90")
    with pytest.raises(sparsegen.ArchError, match="arch"):
        dec.get_decode_kernel(PHI3, dtype=torch.float16, arch="sm_70")


def test_include_dir_found():
    assert (nb.cuda_include_dir() + "/cuda_bf16.h") and nb._has_headers(nb.cuda_include_dir())


def test_get_kernel_aot_cache_and_memo(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "c"))
    dec.forget()
    found = sparsegen.lookup_kernel(PHI3, "decode", dtype=torch.bfloat16, arch="sm_90", page_size=16)
    k = found.kernel
    assert found.status == "compiled" and k.name == "decode_bf16_hd128_ps16_g4_bs64_l16_v8"
    assert k.key.startswith(k.name + "-") and k.path and "sparsegen_paged_decode" in k.source
    assert len(k.cubin) > 1000 and callable(k)
    again = sparsegen.lookup_kernel(PHI3, "decode", dtype=torch.bfloat16, arch="sm_90", page_size=16)
    assert again.kernel is k and again.status == "memory"
    assert not hasattr(k, "status")  # the status travels beside the kernel, never on it
    # A fresh process (empty memos) finds it on disk; with JIT disabled it still loads.
    dec.forget()
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "1")
    k3 = sparsegen.lookup_kernel(
        LayerSpec.from_json(PHI3.to_json()), "decode", dtype=torch.bfloat16, arch="sm_90"
    )
    assert k3.status == "cached" and k3.kernel.key == k.key and k3.kernel.cubin == k.cubin
    with pytest.raises(sparsegen.JitDisabledError):
        dec.get_decode_kernel(PHI3, dtype=torch.float16, arch="sm_90")


def test_repeated_get_kernel_is_a_memo_hit(monkeypatch):
    """A repeat neither hashes a key nor touches the cache (that is what makes it ~1 us)."""
    kernel = dec.get_decode_kernel(PHI3, dtype=torch.bfloat16, arch="sm_90")

    def no_lookup(*args, **kwargs):
        raise AssertionError("a repeated get_kernel went past the memo")

    monkeypatch.setattr(sparsegen.jit.cache, "make_key", no_lookup)
    monkeypatch.setattr(sparsegen.jit.cache, "load_or_build", no_lookup)
    for _ in range(100):
        assert sparsegen.get_kernel(PHI3, "decode", dtype=torch.bfloat16, arch="sm_90") is kernel


@settings(max_examples=50, deadline=None)
@given(
    layer=layer_specs(max_kv_heads=2),
    page_size=st.sampled_from((8, 16, 32, 64, 128, 24)),
    dtype=st.sampled_from(("fp16", "bf16")),
    arch=st.sampled_from(("sm_80", "sm_90")),
)
@pytest.mark.slow
def test_nvrtc_compiles_random_specs(layer, page_size, dtype, arch):
    src = dt.render_source(layer, dtype, page_size)
    cubin, _ = nb.compile_cubin(src, arch, name="fuzz.cu")
    assert cubin[:4] == b"\x7fELF"


def test_cuda_core_loads_once_under_threads():
    """Threads that build decode kernels side by side all get a fully loaded cuda.core (a fresh
    process, so that the first import happens in the threads)."""
    script = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from sparsegen.jit import nvrtc_build as nb\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    mods = list(pool.map(lambda _: nb._core(), range(8)))\n"
        "assert all(m is mods[0] and hasattr(m, 'ProgramOptions') for m in mods)\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
