"""The one kernel lifecycle (sparsegen.kernels.base): requests, the memo, keys over the rendered
source, status beside the kernel, golden decode source."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from helpers import extras

import sparsegen
from sparsegen import HeadSpec, InputError, LayerSpec
from sparsegen.kernels import base, decode_template, prefill_template
from sparsegen.kernels.base import INTERPRETER_ARCH, KernelRequest

GOLDEN = Path(__file__).parent / "golden"
TINY = LayerSpec(2, 1, 64, (HeadSpec(block_size=16, local_blocks=2, vert_stride=4, vert_offset=1),) * 2)


def test_gluon_prefill_source_matches_golden():
    """The sm_90 Gluon kernel of phi3small's sparse layer, rule config (the source run on the H200
    in session 4). After a deliberate template change, regenerate with tests/kernels/golden/regenerate.py."""
    from sparsegen.kernels import prefill_gluon_template

    layer = sparsegen.get_pattern("phi3small").layers[0]
    want = (GOLDEN / "prefill_gluon_phi3small_bf16.py.txt").read_text()
    assert prefill_gluon_template.render_source(layer, "bf16") == want


def test_decode_source_matches_golden():
    """After a deliberate template change, regenerate with tests/kernels/golden/regenerate.py."""
    layer = sparsegen.get_pattern("phi3small").layers[0]
    source = decode_template.render_source(layer, "bf16", 16)
    assert source == (GOLDEN / "decode_phi3small_bf16_ps16.cu.txt").read_text()
    assert "#define CHUNK 64" in source and "#define MAX_SPLITS 256" in source  # rendered from Python


def test_request_is_frozen_and_checked():
    req = KernelRequest.make("decode", TINY, dtype=torch.float16, arch="sm_90")
    assert (req.dtype, req.page_size, req.variant) == ("fp16", 16, "cuda")
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.arch = "sm_80"  # type: ignore[misc]
    assert KernelRequest.make("decode", TINY, dtype="fp16", arch="sm_90") == req
    for bad in (
        dict(kind="both"),
        dict(variant="gluon2"),
        dict(kind="prefill", page_size=16),
        dict(page_size=7),
        dict(page_size=True),
        dict(dtype=torch.float32),
    ):
        kwargs = {"kind": "decode", "dtype": torch.float16, "arch": "sm_90", **bad}
        with pytest.raises(InputError):
            KernelRequest.make(kwargs.pop("kind"), TINY, **kwargs)


def test_bf16_in_the_interpreter_is_refused():
    with pytest.raises(sparsegen.ImplUnavailableError, match="bf16"):
        KernelRequest.make("prefill", TINY, dtype=torch.bfloat16, arch=INTERPRETER_ARCH)


OFFSETS = LayerSpec(
    2, 1, 64, tuple(HeadSpec(block_size=16, local_blocks=2, vert_stride=4, vert_offset=o) for o in (1, 2))
)


def _prefill_key(monkeypatch) -> base.Lookup:
    return base.lookup(KernelRequest.make("prefill", OFFSETS, dtype=torch.float16, arch=INTERPRETER_ARCH))


def test_stale_key_prefill_python_constant(fresh_cache, monkeypatch):
    """Editing the Python that computes a template constant changes the key and rebuilds."""
    first = _prefill_key(monkeypatch)
    assert first.status == "compiled" and "vert_offset = (h * 1 + 1) % vert_stride" in first.kernel.source
    base.forget()
    assert _prefill_key(monkeypatch).status == "cached"
    base.forget()
    monkeypatch.setattr(prefill_template, "_affine_offsets", lambda *a: None)  # a "new" constant rule
    second = _prefill_key(monkeypatch)
    assert second.status == "compiled" and second.kernel.key != first.kernel.key
    assert "vert_offset = tl.where((h == 1), 2, vert_offset)" in second.kernel.source


def test_stale_key_decode_split_weights(fresh_cache, monkeypatch):
    """The issue's defect: split_weights() is Python, not template bytes; it must reach the key."""
    first = sparsegen.lookup_kernel(TINY, "decode", dtype=torch.float16, arch="sm_90")
    assert first.status == "compiled"
    base.forget()
    monkeypatch.setattr(decode_template, "split_weights", lambda heads: (3, 5))
    second = sparsegen.lookup_kernel(TINY, "decode", dtype=torch.float16, arch="sm_90")
    assert second.status == "compiled" and second.kernel.key != first.kernel.key
    assert "NEAR_CHUNKS = 3" in second.kernel.source and "FAR_W = 5" in second.kernel.source


def test_status_is_beside_the_kernel_and_repeat_is_fast(fresh_cache):
    first = sparsegen.lookup_kernel(TINY, "prefill", dtype=torch.float16, arch=INTERPRETER_ARCH)
    again = sparsegen.lookup_kernel(TINY, "prefill", dtype=torch.float16, arch=INTERPRETER_ARCH)
    assert first.status == "compiled" and again.status == "memory" and again.kernel is first.kernel
    assert not hasattr(first.kernel, "status")
    kernel = sparsegen.get_kernel(TINY, "prefill", dtype=torch.float16, arch=INTERPRETER_ARCH)
    for attr in ("name", "key", "path", "source", "arch", "launch"):
        assert getattr(kernel, attr)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        sparsegen.get_kernel(TINY, "prefill", dtype=torch.float16, arch=INTERPRETER_ARCH)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 50e-6, f"a repeated get_kernel took {per_call * 1e6:.1f} us"  # ~2 us measured


def test_equal_spec_objects_share_one_kernel(fresh_cache):
    a = sparsegen.get_kernel(TINY, "prefill", dtype=torch.float16, arch=INTERPRETER_ARCH)
    b = sparsegen.get_kernel(
        LayerSpec.from_json(TINY.to_json()), "prefill", dtype="fp16", arch=INTERPRETER_ARCH
    )
    assert a is b


def test_names_of_many_head_groups_stay_short():
    """Found by the interpreter fuzz: a layer of many head groups overflowed the cache's 200-character names."""
    kinds = [dict(local_blocks=11), dict(sliding_window=1001), dict(local_blocks=12, vert_stride=13, vert_offset=1),
             dict(local_blocks=14, sliding_window=1002), dict(vert_stride=15, vert_offset=2, sliding_window=1003),
             dict(local_blocks=16, vert_stride=17, vert_offset=3, sliding_window=1004)]  # fmt: skip
    heads = tuple(HeadSpec(block_size=16 << (h // 6 % 3), **kinds[h % 6]) for h in range(16))
    layer = LayerSpec(16, 2, 64, heads)
    name = prefill_template.kernel_name(layer, "fp16")
    assert len(name) <= 200 and name.endswith("more"), name
    assert len(decode_template.kernel_name(layer, "fp16", 16)) <= 200
    assert "more" not in prefill_template.kernel_name(TINY, "fp16")
    assert sparsegen.get_kernel(layer, "prefill", dtype=torch.float16, arch=INTERPRETER_ARCH).name == name


def test_knob_variants_are_ordinary_cached_requests(fresh_cache):
    """Template knobs (benchmarks, tests) are part of the request and its key: a variant builds
    once, is cached like any kernel, and leaves the default kernel's key alone."""
    extras.require("cuda.core")
    from sparsegen.kernels import decode

    plain = base.key_of(KernelRequest.make("decode", TINY, dtype="fp16", arch="sm_90"))
    variant = KernelRequest.make("decode", TINY, dtype="fp16", arch="sm_90", knobs={"fused_merge": 0})
    assert base.key_of(variant).key != plain.key and base.key_of(variant).name == plain.name + "_fused_merge0"
    assert base.lookup(variant).status == "compiled"
    base.forget()
    kernel = decode.get_decode_kernel(TINY, dtype="fp16", arch="sm_90", knobs={"fused_merge": 0})
    assert not kernel.fused_merge and kernel.key == base.key_of(variant).key.key
    assert base.lookup(variant).status == "memory"
    with pytest.raises(InputError, match="unknown decode template knobs"):
        KernelRequest.make("decode", TINY, dtype="fp16", arch="sm_90", knobs={"nope": 1})
    with pytest.raises(InputError, match="take no knobs"):
        KernelRequest.make("prefill", TINY, dtype="fp16", arch=INTERPRETER_ARCH, knobs={"block_m": 16})
