"""The per-render budget: a template render that produces more than `RENDER_BUDGET` characters is
refused with RenderLimitError (naming the kernel and its spec) before anything compiles; the
real kernels stay far below it, and the render streams, so a runaway stops at the bound."""

from __future__ import annotations

import random
import time

import jinja2
import pytest

from sparsegen import get_kernel
from sparsegen.errors import CompileError, RenderLimitError, SparsegenError
from sparsegen.jit import render as jit_render
from sparsegen.kernels import base
from sparsegen.kernels.base import KernelRequest, key_of
from sparsegen.presets import PRESETS, get_pattern
from sparsegen.spec import MAX_HEADS, HeadSpec, LayerSpec

KINDS = (("prefill", "tl", {}), ("prefill", "gluon", {}), ("decode", "cuda", {"page_size": 16}))


def _source(layer, kind, variant, extra) -> str:
    return key_of(
        KernelRequest.make(kind, layer, dtype="bf16", arch="sm_90", variant=variant, **extra)
    ).source


def _edge_layer(num_heads: int) -> LayerSpec:
    """Every head its own pattern (the most a template unrolls per head)."""
    rng = random.Random(0)
    heads = []
    for _ in range(num_heads):
        stride = rng.randint(1, 8)
        heads.append(HeadSpec(block_size=rng.choice((16, 32, 64, 128)), local_blocks=rng.randint(1, 6),
                              vert_stride=stride, vert_offset=rng.randint(0, stride - 1),
                              sliding_window=rng.randint(1, 10_000)))  # fmt: skip
    return LayerSpec(num_heads=num_heads, num_kv_heads=num_heads // 8, head_dim=128, heads=tuple(heads))


@pytest.mark.parametrize("kind,variant,extra", KINDS, ids=[f"{k}-{v}" for k, v, _ in KINDS])
def test_the_presets_render_far_below_the_budget(kind, variant, extra):
    sizes = [len(_source(layer, kind, variant, extra)) for name in PRESETS
             for layer, _ in get_pattern(name).distinct_layers()]  # fmt: skip
    assert 1000 < max(sizes) <= 40_000, sizes  # the measured largest (decode) is about 33,000
    assert jit_render.RENDER_BUDGET >= 50 * max(sizes)


def test_a_legal_edge_spec_prefill_renders_within_the_budget():
    assert len(_source(_edge_layer(MAX_HEADS), "prefill", "tl", {})) < jit_render.RENDER_BUDGET // 4


@pytest.mark.slow
def test_a_legal_edge_spec_decode_renders_within_the_budget():
    """1,024 heads, each its own pattern: the CUDA decode template's largest legal render (~430,000)."""
    assert (
        len(_source(_edge_layer(MAX_HEADS), "decode", "cuda", {"page_size": 16}))
        < jit_render.RENDER_BUDGET // 2
    )


@pytest.mark.parametrize("kind,variant,extra", KINDS, ids=[f"{k}-{v}" for k, v, _ in KINDS])
def test_over_the_budget_is_refused_naming_the_spec(monkeypatch, kind, variant, extra):
    layer = get_pattern("phi3small").layers[1]
    monkeypatch.setattr(jit_render, "RENDER_BUDGET", 2000)
    with pytest.raises(RenderLimitError) as info:
        _source(layer, kind, variant, extra)
    err = info.value
    assert isinstance(err, CompileError) and isinstance(err, SparsegenError)
    assert err.limit == 2000 and err.template.endswith(".jinja") and err.spec == layer.to_json()
    text = str(err)
    assert "more than 2,000 characters" in text and "refused before compiling" in text
    assert text.startswith(f"kernel {kind}_") and '"block_size":64' in text


def test_nothing_is_built_or_cached_when_refused(monkeypatch, fresh_cache):
    monkeypatch.setattr(jit_render, "RENDER_BUDGET", 500)
    built = []
    for fam_kind, variant in (("prefill", "tl"), ("decode", "cuda")):
        fam = base.family(KernelRequest.make(fam_kind, get_pattern("dense").layers[0], dtype="bf16",
                                             arch="sm_90", variant=variant))  # fmt: skip
        monkeypatch.setattr(type(fam), "build", lambda self, *a, **k: built.append(a) or {})
    for kind, extra in (("prefill", {}), ("decode", {"page_size": 16})):
        with pytest.raises(RenderLimitError):
            get_kernel(get_pattern("dense").layers[0], kind, dtype="bf16", arch="sm_90", **extra)
    assert built == [] and not any(fresh_cache.rglob("*.cubin")) and not any(fresh_cache.rglob("kernel.py"))


def test_a_long_spec_is_shown_cut_but_kept_whole(monkeypatch):
    monkeypatch.setattr(jit_render, "RENDER_BUDGET", 1000)
    layer = _edge_layer(64)
    with pytest.raises(RenderLimitError) as info:
        _source(layer, "prefill", "tl", {})
    assert info.value.spec == layer.to_json() and len(layer.to_json()) > 600
    assert "characters)" in str(info.value) and len(str(info.value)) < 1200


def _env_with(**templates) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.DictLoader(templates), undefined=jinja2.StrictUndefined)


@pytest.mark.parametrize("n,refused", [(0, False), (999, False), (1000, False), (1001, True), (10**12, True)])
def test_the_bound_is_exact_and_a_runaway_stops_at_it(monkeypatch, n, refused):
    monkeypatch.setattr(jit_render, "RENDER_BUDGET", 1000)
    monkeypatch.setattr(
        jit_render, "_environment", lambda: _env_with(t="{% for i in range(n) %}x{% endfor %}")
    )
    start = time.perf_counter()
    if refused:
        with pytest.raises(RenderLimitError, match="rendering t produced more than 1,000 characters"):
            jit_render.render("t", n=n)
    else:
        assert jit_render.render("t", n=n) == "x" * n
    # a hang guard: 10**12 iterations would never end; the render streams
    assert time.perf_counter() - start < 60


def test_the_default_budget_holds_a_large_render(monkeypatch):
    monkeypatch.setattr(jit_render, "_environment", lambda: _env_with(t="{{ 'y' * n }}"))
    assert len(jit_render.render("t", n=jit_render.RENDER_BUDGET)) == jit_render.RENDER_BUDGET
    with pytest.raises(RenderLimitError):
        jit_render.render("t", n=jit_render.RENDER_BUDGET + 1)
