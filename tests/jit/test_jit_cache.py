"""The prefill kernel cache: keys, races, corrupt entries, DISABLE_JIT, AOT builds without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import extras

import sparsegen
from sparsegen import HeadSpec, JitDisabledError, LayerSpec
from sparsegen.jit import cache
from sparsegen.kernels import prefill as prefill_mod
from sparsegen.kernels import prefill_template

SMALL = LayerSpec(
    num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(block_size=16, local_blocks=2),) * 2
)


@pytest.fixture(autouse=True)
def _fresh(fresh_cache):
    yield fresh_cache


def _key(template=b"t", spec=SMALL, extra=None):
    return cache.make_key("n", spec_json=spec.to_json(), template=template, arch="sm_90", extra=extra)


def test_key_changes_with_template_spec_and_versions(monkeypatch):
    base = _key()
    assert _key(template=b"u") != base  # one template byte
    other = LayerSpec(2, 1, 64, (HeadSpec(block_size=16, local_blocks=3),) * 2)
    assert _key(spec=other) != base
    assert _key(extra={"a": 1, "b": 2}) == _key(extra={"b": 2, "a": 1})  # dict order is irrelevant
    versions = dict(cache.toolchain_versions())
    monkeypatch.setattr(cache, "toolchain_versions", lambda: {**versions, "triton": "0.0.0"})
    assert _key() != base


def test_prefill_key_pins_template_and_config():
    kernel = prefill_mod.get_prefill_kernel(SMALL, dtype=torch.float16, arch="sm_90", variant="tl")
    assert kernel.key.startswith("prefill_fp16_hd64_h2kv1_bs16_l2-")
    meta = json.loads((kernel.path / "manifest.json").read_text())["meta"]
    assert meta["config"] == prefill_template.pick_config("fp16", 64, "sm_90")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_aot_compile_phi3small_without_gpu(arch):
    for layer, _ in sparsegen.get_pattern("phi3small").distinct_layers():
        found = sparsegen.lookup_kernel(layer, "prefill", dtype=torch.bfloat16, arch=arch)
        kernel = found.kernel
        assert found.status == "compiled"
        meta = json.loads((kernel.path / "prefill_kernel.json").read_text())
        assert meta["target"]["arch"] == int(arch[3:])
        assert (kernel.path / "prefill_kernel.cubin").stat().st_size > 1000
        assert "def prefill_kernel" in kernel.source


def test_repeated_get_kernel_is_a_memo_hit(monkeypatch):
    """A repeat neither hashes a key nor touches the cache (that is what makes it ~1 us)."""
    kernel = sparsegen.get_kernel(SMALL, "prefill", dtype=torch.float16, arch="sm_90")

    def no_lookup(*args, **kwargs):
        raise AssertionError("a repeated get_kernel went past the memo")

    monkeypatch.setattr(cache, "make_key", no_lookup)
    monkeypatch.setattr(cache, "load_or_build", no_lookup)
    for _ in range(100):
        assert sparsegen.get_kernel(SMALL, "prefill", dtype=torch.float16, arch="sm_90") is kernel


def test_truncated_entry_is_rebuilt():
    kernel = prefill_mod.get_prefill_kernel(SMALL, dtype=torch.float16, arch="sm_90")
    cubin = kernel.path / "prefill_kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[:100])
    prefill_mod.forget()
    again = sparsegen.lookup_kernel(SMALL, "prefill", dtype=torch.float16, arch="sm_90")
    assert again.status == "compiled" and cubin.stat().st_size > 1000


def test_disable_jit_raises_on_miss_and_works_after_compile(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError, match="sparsegen compile"):
        prefill_mod.get_prefill_kernel(SMALL, dtype=torch.float16, arch="sm_90")
    monkeypatch.delenv("SPARSEGEN_DISABLE_JIT")
    prefill_mod.get_prefill_kernel(SMALL, dtype=torch.float16, arch="sm_90")
    prefill_mod.forget()
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "1")
    assert sparsegen.lookup_kernel(SMALL, "prefill", dtype=torch.float16, arch="sm_90").status == "cached"


RACE = """
import torch, sparsegen
from sparsegen import HeadSpec, LayerSpec
layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(block_size=32, sliding_window=50),) * 2)
print(sparsegen.lookup_kernel(layer, "prefill", dtype=torch.float16, arch="sm_90").status)
"""


@pytest.mark.slow
def test_four_processes_racing_build_once(fresh_cache):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    statuses = sorted(out.strip() for out, _ in results)
    assert statuses == ["cached", "cached", "cached", "compiled"]
    assert len([p for p in fresh_cache.iterdir() if p.is_dir()]) == 1


def test_template_bytes_cover_included_parts(tmp_path, monkeypatch):
    from sparsegen.jit import render

    (tmp_path / "main.jinja").write_text("A {% include 'part.jinja' %}")
    (tmp_path / "part.jinja").write_text("B {{ x }}")
    monkeypatch.setattr(render, "templates_dir", lambda: tmp_path)
    render._environment.cache_clear()
    try:
        before = render.template_bytes("main.jinja")
        assert b"B {{ x }}" in before
        (tmp_path / "part.jinja").write_text("C {{ x }}")
        assert render.template_bytes("main.jinja") != before  # an edit to the part changes the key
    finally:
        render._environment.cache_clear()


def test_decode_template_parts_are_in_its_bytes():
    from sparsegen.jit import render

    data = render.template_bytes("paged_decode.cu.jinja")
    for part in (
        "paged_decode_common.cuh.jinja",
        "paged_decode_pattern.cuh.jinja",
        "paged_decode_loads.cuh.jinja",
        "paged_decode_reduce.cuh.jinja",
    ):
        assert part.encode() in data and render._read_template(part) in data


def test_nvrtc_version_matches_the_library_cuda_core_loads():
    """The key's NVRTC version comes from the wheel's metadata; it must name the loaded library."""
    nvrtc = extras.require("cuda.bindings.nvrtc")
    err, major, minor = nvrtc.nvrtcVersion()
    assert int(err) == 0
    assert cache.nvrtc_version().startswith(f"{major}.{minor}")
