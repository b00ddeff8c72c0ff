"""The CUDA decode launcher on the CPU: the 22 packed arguments of `DecodeKernel.launch` against
the kernel's parameter list parsed from the rendered source (order, C type, value), the grid and
the reduce launch; and the engine's default GPU KV-cache size from a faked `mem_get_info`."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels import decode_template as tpl
from sparsegen.kernels.base import KernelRequest
from sparsegen.kernels.families import decode as decode_mod
from sparsegen.presets import blocksparse_heads
from sparsegen.runner import model_runner
from sparsegen.testing import DecodeProblem

C_TYPES = {"long long": np.int64, "int": np.int32, "float": np.float32}  # pointers travel as np.uint64


def _params(source: str, fn: str) -> list[tuple[str, str]]:
    """(name, C type) of each parameter of the extern "C" kernel `fn` in a rendered source;
    a pointer's type is "ptr"."""
    head = re.search(
        rf'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?{fn}\((.*?)\)\s*{{', source, re.S
    )
    assert head, f"no kernel {fn} in the source"
    out = []
    for decl in head.group(1).split(","):
        decl = " ".join(decl.replace("__restrict__", "").split())
        name = decl.rsplit(" ", 1)[-1].lstrip("*")
        out.append((name, "ptr" if "*" in decl else decl.rsplit(" ", 1)[0].replace("const ", "")))
    return out


class _FakeModule:
    """Records each launch instead of running it."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def launch(self, name, stream, grid, block, *args, pdl=False):
        self.launches.append((name, grid, block, args, pdl))


LAYERS = {
    "phi3_gqa4": LayerSpec(8, 2, 128, blocksparse_heads(8, block_size=64, local_blocks=16, vert_stride=8, total_heads=32)),
    "window_gqa8": LayerSpec(8, 1, 64, (HeadSpec(block_size=16, sliding_window=300),) * 8),
    "dense_mha_hd96": LayerSpec(2, 2, 96, (HeadSpec(dense=True),) * 2),
    "hybrid_gqa2": LayerSpec(4, 2, 64, (HeadSpec(dense=True), HeadSpec(block_size=32, local_blocks=2),
                                        HeadSpec(block_size=16, local_blocks=1, vert_stride=3, vert_offset=1), HeadSpec(block_size=64, sliding_window=70))),
}  # fmt: skip
CASES = [  # (layer, page size, splits, merge, head-major cache pages)
    ("phi3_gqa4", 16, 1, None, False),
    ("phi3_gqa4", 16, 48, "fused", True),
    ("window_gqa8", 8, 3, "separate", False),
    ("dense_mha_hd96", 128, 17, "separate", True),
    ("hybrid_gqa2", 24, 2, "fused", False),
    ("hybrid_gqa2", 64, 5, "separate", True),
]


@pytest.fixture
def fake_launch(monkeypatch):
    module = _FakeModule()
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(decode_mod.DecodeKernel, "_module", lambda self, device: module)
    monkeypatch.setattr(decode_mod, "COUNTERS", SimpleNamespace(get=lambda device, stream, n: counters))
    monkeypatch.setattr(decode_mod.env, "supports_pdl", lambda device=None: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return module, counters


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}_ps{c[1]}_s{c[2]}_{c[3]}_{'hm' if c[4] else 'tm'}"
)
def test_packed_arguments_match_the_rendered_kernel_signature(case, fake_launch):
    module, counters = fake_launch
    name, page_size, splits, merge, head_major = case
    layer = LAYERS[name]
    request = KernelRequest.make("decode", layer, dtype="bf16", arch="sm_90", page_size=page_size)
    source = decode_mod.CudaDecode().render(request)
    kernel = decode_mod.DecodeKernel(request, "key", "name", "/nonexistent", source, b"")
    p = DecodeProblem(layer, [1, 300, 777], page_size, seed=1, dtype=torch.bfloat16)
    q, kc, vc, bt, sl, _, _ = p.args()
    if head_major:  # [pages, Hkv, page, D] storage seen as [pages, page, Hkv, D]: other strides
        kc, vc = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
    q = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype)[..., : layer.head_dim]  # strided q
    scale = 0.07
    out = kernel.launch(q, kc, vc, bt, sl, scale, splits=splits, merge=merge)

    params = _params(source, tpl.KERNEL)
    assert len(params) == 22
    fused = splits > 1 and decode_mod.use_fused(splits, tpl.heads_per_block(layer), layer.head_dim, merge)
    kname, grid, block, args, pdl = module.launches[0]
    assert kname == tpl.KERNEL and block == 128 and pdl is False
    groups = layer.num_heads // tpl.heads_per_block(layer)
    assert grid == (splits, groups, q.shape[0])
    for (pname, ctype), value in zip(params, args, strict=True):
        assert type(value) is (np.uint64 if ctype == "ptr" else C_TYPES[ctype]), (pname, ctype, type(value))
    got = dict(zip((n for n, _ in params), args, strict=True))
    want = {
        "q": q.data_ptr(), "q_sb": q.stride(0), "q_sh": q.stride(1),
        "k_cache": kc.data_ptr(), "k_sp": kc.stride(0), "k_st": kc.stride(1), "k_sh": kc.stride(2),
        "v_cache": vc.data_ptr(), "v_sp": vc.stride(0), "v_st": vc.stride(1), "v_sh": vc.stride(2),
        "block_tables": bt.data_ptr(), "bt_sb": bt.stride(0), "max_pages": bt.shape[1], "num_pages": kc.shape[0],
        "seq_lens": sl.data_ptr(), "out": out.data_ptr(), "num_splits": splits,
        "counters": counters.data_ptr() if fused else 0,
    }  # fmt: skip
    for key, value in want.items():
        assert int(got[key]) == value, key
    assert got["scale_log2"] == np.float32(scale * math.log2(math.e))
    if splits == 1:
        assert got["part_o"] == 0 and got["part_ml"] == 0 and len(module.launches) == 1
        return
    assert got["part_o"] != 0 and got["part_ml"] != 0 and got["part_o"] != got["part_ml"]
    if merge == "separate":  # the reduce kernel reads the same partials and writes the same output
        rname, rgrid, rblock, rargs, _ = module.launches[1]
        rparams = _params(source, tpl.REDUCE)
        assert rname == tpl.REDUCE and [t for _, t in rparams] == ["ptr", "ptr", "ptr", "int"]
        assert [int(a) for a in rargs] == [int(got["part_o"]), int(got["part_ml"]), out.data_ptr(), splits]
        assert [type(a) for a in rargs] == [np.uint64, np.uint64, np.uint64, np.int32]
        assert rgrid == (q.shape[0] * layer.num_heads, -(-layer.head_dim // 32))
        assert rblock == (32, min(tpl.REDUCE_WARPS, splits))
    else:
        assert fused and len(module.launches) == 1


def test_the_heuristic_split_count_is_what_the_kernel_gets(fake_launch, monkeypatch):
    module, _ = fake_launch
    monkeypatch.setattr(decode_mod, "_sm_count", lambda device: 132)
    layer = LAYERS["phi3_gqa4"]
    request = KernelRequest.make("decode", layer, dtype="bf16", arch="sm_90", page_size=16)
    kernel = decode_mod.DecodeKernel(
        request, "key", "name", "/nonexistent", decode_mod.CudaDecode().render(request), b""
    )
    p = DecodeProblem(layer, [8192], 16, seed=2, dtype=torch.bfloat16, spare_pages=0)
    q, kc, vc, bt, sl, _, _ = p.args()
    kernel.launch(q, kc, vc, bt[:, :512].contiguous(), sl, 0.1)
    assert module.launches[0][1][0] == 48  # decode.num_splits' pick at 1 x 8K on 132 SMs


def _fake_gpu_model():
    from sparsegen.models import random_model

    model = random_model("tiny", seed=0, attn_impl="reference")
    return SimpleNamespace(
        config=model.config,
        dtype=torch.bfloat16,
        device=torch.device("cuda", 1),
        local_num_kv_heads=model.config.num_key_value_heads,
    )


@pytest.mark.parametrize("free_gib", [80, 7, 0.5])
@pytest.mark.parametrize("prefill_tokens", [256, 1 << 20])
def test_default_gpu_cache_takes_free_memory_less_headroom(free_gib, prefill_tokens, monkeypatch):
    model = _fake_gpu_model()
    free = int(free_gib * 2**30)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (free, 141 << 30))
    cfg = model.config
    per_page = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    act = prefill_tokens * (3 * cfg.ff_intermediate_size + (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                            * cfg.head_dim + 4 * cfg.hidden_size) * 2  # fmt: skip
    headroom = max(6 << 30, act + (2 << 30))  # the rule: a prefill step + 2 GiB, at least 6 GiB
    want = max(int(free * 0.9) - headroom, 2 * per_page) // per_page
    got = model_runner.default_num_pages(model, 16, None, prefill_tokens)
    assert asked == [torch.device("cuda", 1)] and got == want
    if free_gib == 0.5:
        assert got == 2  # nothing left after the headroom: the smallest cache, not an error
    elif free_gib == 80 and prefill_tokens == 256:
        assert got == (int(80 * 2**30 * 0.9) - (6 << 30)) // per_page
    assert model_runner.default_num_pages(model, 16, 10 * per_page + 5, prefill_tokens) == 10  # bytes given
    assert len(asked) == 1  # a given size never asks the GPU


SINK_LAYER = LayerSpec(4, 2, 48, (HeadSpec(block_size=16, local_blocks=2, sink_tokens=4),) * 4, logit_softcap=20.0,
                       learned_sinks=True)  # fmt: skip


@pytest.mark.parametrize("splits,merge", [(1, None), (6, "fused"), (6, "separate")])
def test_learned_sinks_pointer_is_the_last_argument_of_both_kernels(splits, merge, fake_launch):
    """A learned-sinks layer (head_dim 48: a half-full last 32-dim slice in the reduce grid)
    passes the [H] float32 sinks pointer as the 23rd kernel argument and the reduce kernel's 5th."""
    module, _ = fake_launch
    request = KernelRequest.make("decode", SINK_LAYER, dtype="fp16", arch="sm_90", page_size=16)
    source = decode_mod.CudaDecode().render(request)
    kernel = decode_mod.DecodeKernel(request, "key", "name", "/nonexistent", source, b"")
    p = DecodeProblem(SINK_LAYER, [5, 400], 16, seed=3, dtype=torch.float16)
    q, kc, vc, bt, sl, _, _ = p.args()
    sinks = torch.randn(SINK_LAYER.num_heads, dtype=torch.float32)
    kernel.launch(q, kc, vc, bt, sl, 0.1, splits=splits, merge=merge, sinks=sinks)
    params = _params(source, tpl.KERNEL)
    assert len(params) == 23 and params[-1] == ("sinks", "ptr")
    args = module.launches[0][3]
    assert len(args) == 23 and type(args[-1]) is np.uint64 and int(args[-1]) == sinks.data_ptr()
    if merge == "separate":
        rname, rgrid, _, rargs, _ = module.launches[1]
        assert [t for _, t in _params(source, tpl.REDUCE)] == ["ptr", "ptr", "ptr", "int", "ptr"]
        assert int(rargs[-1]) == sinks.data_ptr() and len(rargs) == 5
        assert rgrid == (q.shape[0] * SINK_LAYER.num_heads, 2)  # 48 dims: slices of 32 and 16
    else:
        assert len(module.launches) == 1


def test_sinks_must_come_exactly_with_the_flag(fake_launch):
    from sparsegen.errors import InputError

    request = KernelRequest.make("decode", SINK_LAYER, dtype="fp16", arch="sm_90", page_size=16)
    kernel = decode_mod.DecodeKernel(request, "key", "name", "/nonexistent", "", b"")
    q, kc, vc, bt, sl, _, _ = DecodeProblem(SINK_LAYER, [5], 16, seed=3, dtype=torch.float16).args()
    with pytest.raises(InputError, match="learned_sinks"):
        kernel.launch(q, kc, vc, bt, sl, 0.1)
    plain = LAYERS["window_gqa8"]
    request = KernelRequest.make("decode", plain, dtype="fp16", arch="sm_90", page_size=8)
    kernel = decode_mod.DecodeKernel(request, "key", "name", "/nonexistent", "", b"")
    q, kc, vc, bt, sl, _, _ = DecodeProblem(plain, [5], 8, seed=3, dtype=torch.float16).args()
    with pytest.raises(InputError, match="learned_sinks"):
        kernel.launch(q, kc, vc, bt, sl, 0.1, sinks=torch.zeros(plain.num_heads))
