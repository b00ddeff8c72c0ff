"""`sparsegen bench --kind prefill` on the CPU: its cases, the ratio / ceiling arithmetic, the
"n/a" columns when FA4 is absent, the JSON rows, and the FA4 / FlexAttention wiring.

The GPU timing itself runs only on the device; here every timer is a test double (a lambda that
calls the function once and returns a chosen number), and FA4 is a test double module injected
as `flash_attn.cute` through sys.modules: it computes attention with sparsegen.reference from
the keyword arguments it is handed, so a wrong mapping of the layer to FA4's arguments (window
off by one, a missing soft-cap or sink, a transposed layout) gives a wrong output.
"""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

from sparsegen import HeadSpec, LayerSpec, reference
from sparsegen.commands.bench import SUMMARY_COLUMNS, cases, peers
from sparsegen.commands.table import format_table
from sparsegen.errors import InputError
from sparsegen.testing import rel_err


def _fixed_timer(ms: float):
    """Test double for median_ms: runs fn once (so a failing peer still fails) and returns ms."""

    def timer(fn):
        fn()
        return ms

    return timer


def _inputs(layer: LayerSpec, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.randn(n, h, d, generator=gen)  # [S, H, D]
    k = torch.randn(n, hkv, d, generator=gen)  # [S, Hkv, D]
    v = torch.randn(n, hkv, d, generator=gen)
    sinks = torch.randn(h, generator=gen) if layer.learned_sinks else None  # [H] fp32
    return q, k, v, sinks


def _ref(layer, q, k, v, sinks):
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return reference.prefill(q, k, v, cu, cu, layer, sinks=sinks)


# -- the case list ---------------------------------------------------------------------------


def test_the_cases_are_issue_28s_table():
    got = [(c.name, c.seq_len, c.long) for c in cases.PREFILL_CASES]
    assert got == [
        ("dense", 8192, False), ("dense", 32768, False), ("dense", 131072, True),
        ("window", 8192, False), ("window", 32768, False),
        ("phi3small", 8192, False), ("phi3small", 32768, False),
        ("gpt-oss", 8192, False), ("gpt-oss", 32768, False),
        ("gemma2", 8192, False), ("gemma2", 32768, False),
    ]  # fmt: skip
    dense, window, phi, oss, gemma = (
        cases.LAYERS[n]() for n in ("dense", "window", "phi3small", "gpt-oss", "gemma2")
    )
    assert (dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.is_dense) == (32, 8, 128, True)
    assert {h.kind for h in window.heads} == {"window"} and window.heads[0].sliding_window == 4096
    assert (window.num_heads, window.num_kv_heads, window.head_dim) == (32, 8, 128)
    assert phi.heads[0].kind == "local+vert"
    assert (oss.num_heads, oss.num_kv_heads, oss.head_dim, oss.learned_sinks) == (64, 8, 64, True)
    assert {h.sliding_window for h in oss.heads} == {128}
    assert (gemma.num_heads, gemma.num_kv_heads, gemma.head_dim, gemma.logit_softcap) == (16, 8, 256, 50.0)
    assert gemma.default_scale == 256**-0.5 and gemma.heads[0].sliding_window == 4096


def test_128k_runs_only_behind_long_and_names_filter():
    short = cases.select_cases(long=False, max_seq_len=131072)
    assert all(c.seq_len <= 32768 for c in short) and len(short) == 10
    assert [c.seq_len for c in cases.select_cases(long=True, max_seq_len=131072) if c.long] == [131072]
    assert [c.seq_len for c in cases.select_cases(long=True, max_seq_len=8192)] == [8192] * 5
    assert {c.name for c in cases.select_cases(long=False, max_seq_len=10**6, names=("gpt-oss",))} == {
        "gpt-oss"
    }
    with pytest.raises(InputError, match="unknown prefill case"):
        cases.select_cases(long=False, max_seq_len=8192, names=("gpt_oss",))


# -- ratios and ceilings ---------------------------------------------------------------------


def _row(sg=2.0, floor=1.5, **peer_times):
    row_peers = {p: "n/a (test: did not run)" for p in cases.PEERS}
    row_peers.update(peer_times)
    return {"sparsegen_ms": sg, "floor_ms": floor, "peers": row_peers}


def test_ratio_is_the_fastest_peer_over_sparsegen_and_ceilings_are_floor_over_time():
    row = cases.summarize(_row(sg=2.0, floor=1.5, fa4=1.8, flex=3.0, flex_flash=2.5))
    assert row["best_peer"] == "fa4"
    assert row["x_best_peer"] == pytest.approx(0.9)  # sparsegen 10 % slower than FA4
    assert row["of_ceiling"] == {
        "sparsegen": 0.75,
        "sdpa": None,
        "flex": 0.5,
        "flex_flash": 0.6,
        "fa4": 1.5 / 1.8,
    }
    faster = cases.summarize(_row(sg=1.0, floor=0.5, flex=1.87))
    assert faster["best_peer"] == "flex" and faster["x_best_peer"] == pytest.approx(1.87)


def test_no_peer_ran_gives_nan_not_a_number_made_up():
    row = cases.summarize(_row())
    assert row["best_peer"] is None and math.isnan(row["x_best_peer"])
    assert all(row["of_ceiling"][p] is None for p in cases.PEERS)


@pytest.mark.parametrize(
    "bad",
    [
        {"sg": 0.0},
        {"floor": float("nan")},
        {"fa4": 0.0},
        {"fa4": -1.0},
        {"fa4": "0.87"},
        {"fa4": float("inf")},
        {"fa4": None},
    ],
)
def test_summarize_refuses_values_that_are_not_times_or_n_a(bad):
    args = {k: v for k, v in bad.items() if k in ("sg", "floor")}
    peer = {k: v for k, v in bad.items() if k not in ("sg", "floor")}
    with pytest.raises(InputError):
        cases.summarize(_row(**args, **peer))


def test_summarize_refuses_missing_or_extra_peer_columns():
    row = _row()
    del row["peers"]["fa4"]
    with pytest.raises(InputError, match="exactly the columns"):
        cases.summarize(row)
    row = _row()
    row["peers"]["fa3"] = 1.0
    with pytest.raises(InputError, match="exactly the columns"):
        cases.summarize(row)


# -- the n/a path ----------------------------------------------------------------------------


def test_without_flash_attn_cute_fa4_and_flex_flash_say_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ModuleNotFoundError
    layer = cases.LAYERS["gpt-oss"]()
    q, k, v, sinks = (x[:1] if x is not None else None for x in _inputs(layer, 4))
    assert peers.time_fa4(layer, q, k, v, sinks, timer=_fixed_timer(1.0)) == (peers.NOT_INSTALLED, None)
    got = peers.time_flex(layer, q, k, v, sinks, backend="FLASH", timer=_fixed_timer(1.0))
    assert got == (peers.NOT_INSTALLED, None) == ("n/a (flash_attn.cute not installed)", None)


def test_fa4_cannot_express_phi3small_and_says_so():
    phi = cases.LAYERS["phi3small"]()
    assert peers.fa4_kwargs(phi, None) == "n/a (FA4 takes one pattern for every head)"  # offsets differ
    uniform = LayerSpec(2, 1, 64, (HeadSpec(local_blocks=4, vert_stride=8),) * 2)
    assert peers.fa4_kwargs(uniform, None) == "n/a (FA4 has no local+vert pattern)"
    mixed = LayerSpec(2, 1, 64, (HeadSpec(dense=True), HeadSpec(sliding_window=8)))
    assert peers.fa4_kwargs(mixed, None).startswith("n/a (FA4 takes one pattern")
    sinky = LayerSpec(2, 1, 64, (HeadSpec(sliding_window=8, sink_tokens=4),) * 2)
    assert peers.fa4_kwargs(sinky, None) == "n/a (FA4 has no window+sink pattern)"
    oss = cases.LAYERS["gpt-oss"]()
    assert peers.fa4_kwargs(oss, None).startswith("n/a (the layer has learned sinks")


def test_sdpa_is_a_peer_only_of_a_plain_dense_layer():
    gemma = cases.LAYERS["gemma2"]()
    ms, out = peers.time_sdpa(gemma, *_inputs(gemma, 2)[:3], timer=_fixed_timer(1.0))
    assert ms.startswith("n/a (SDPA computes dense causal") and out is None
    capped = LayerSpec(2, 1, 32, (HeadSpec(dense=True),) * 2, logit_softcap=30.0)
    assert peers.time_sdpa(capped, *_inputs(capped, 8)[:3], timer=_fixed_timer(1.0))[0].startswith("n/a")
    dense = LayerSpec(4, 2, 32, (HeadSpec(dense=True),) * 4)
    q, k, v, _ = _inputs(dense, 40)
    ms, out = peers.time_sdpa(dense, q, k, v, timer=_fixed_timer(0.5))
    assert ms == 0.5 and rel_err(out, _ref(dense, q, k, v, None)) < 1e-5


# -- FA4 wiring, through a test double of flash_attn.cute ------------------------------------


def _fake_fa4(calls: list):
    """A test double of `flash_attn.cute`: flash_attn_func computes the attention its keyword
    arguments describe with sparsegen.reference, in FA4's layout ([B, S, H, D]) and return
    shape ((out, lse)). It accepts keywords only, as FA4 4.0's fourth positional is `qv`."""

    def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None),
                        learnable_sink=None, softcap=0.0):  # fmt: skip
        calls.append({"causal": causal, "window_size": window_size, "softcap": softcap,
                      "sink": learnable_sink, "scale": softmax_scale, "shape": tuple(q.shape)})  # fmt: skip
        assert causal and q.dim() == 4 and q.shape[0] == 1
        _, n, h, d = q.shape
        left = window_size[0]
        head = HeadSpec(dense=True) if left is None else HeadSpec(sliding_window=left + 1)
        layer = LayerSpec(
            h, k.shape[2], d, (head,) * h, logit_softcap=softcap, learned_sinks=learnable_sink is not None
        )
        out = _ref(layer, q[0], k[0], v[0], learnable_sink)  # scale: softmax_scale below
        if softmax_scale is not None:
            cu = torch.tensor([0, n], dtype=torch.int32)
            out = reference.prefill(q[0], k[0], v[0], cu, cu, layer, softmax_scale, sinks=learnable_sink)
        return out.unsqueeze(0), torch.zeros(1, h, n)

    pkg = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    pkg.cute = cute
    return pkg, cute


@pytest.mark.parametrize(
    "layer",
    [
        LayerSpec(8, 1, 32, (HeadSpec(sliding_window=16),) * 8, learned_sinks=True),  # gpt-oss-like, GQA 8:1
        LayerSpec(4, 2, 32, (HeadSpec(sliding_window=24),) * 4, logit_softcap=5.0, scale=0.1),  # gemma-like
        LayerSpec(4, 2, 32, (HeadSpec(dense=True),) * 4),
    ],
    ids=["window_sinks", "window_softcap_scale", "dense"],
)
def test_fa4_column_is_wired_to_flash_attn_func(monkeypatch, layer):
    calls: list = []
    pkg, cute = _fake_fa4(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    q, k, v, sinks = _inputs(layer, 70, seed=3)
    ms, out = peers.time_fa4(layer, q, k, v, sinks, timer=_fixed_timer(0.683))
    assert ms == 0.683
    assert len(calls) == 2  # the warm-up call, then the timer's
    head = layer.heads[0]
    want_window = (None, None) if head.dense else (head.sliding_window - 1, 0)
    assert calls[0]["window_size"] == want_window and calls[0]["scale"] == layer.default_scale
    assert calls[0]["softcap"] == layer.logit_softcap and calls[0]["shape"] == (1, 70, layer.num_heads, 32)
    assert calls[0]["sink"] is sinks and (sinks is not None) == layer.learned_sinks
    assert out.shape == q.shape and rel_err(out, _ref(layer, q, k, v, sinks)) < 1e-5


def test_an_fa4_that_raises_is_an_n_a_column_with_the_reason(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("head_dim 256 is not supported on sm_90")

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = broken
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    layer = cases.LAYERS["gemma2"]()
    ms, out = peers.time_fa4(layer, *_inputs(layer, 2)[:3], timer=_fixed_timer(1.0))
    assert ms == "n/a (FA4: RuntimeError: head_dim 256 is not supported on sm_90)" and out is None


# -- FlexAttention wiring (its Triton path runs eagerly on the CPU) --------------------------


@pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile"
)  # eager on the CPU, on purpose
def test_flex_column_computes_the_layers_attention_with_softcap_and_sinks():
    layer = LayerSpec(4, 2, 32, (HeadSpec(block_size=16, sliding_window=20),) * 4, logit_softcap=4.0,
                      learned_sinks=True)  # fmt: skip
    q, k, v, sinks = _inputs(layer, 64, seed=5)
    ms, out = peers.time_flex(layer, q, k, v, sinks, timer=_fixed_timer(3.0))
    assert ms == 3.0, ms
    assert rel_err(out, _ref(layer, q, k, v, sinks)) < 1e-4


# -- the JSON rows and the table -------------------------------------------------------------


def test_a_row_round_trips_through_json_and_renders_in_the_summary_table():
    row = cases.summarize(_row(sg=0.962, floor=0.77, sdpa=1.1, fa4=0.868, flex=1.4))
    row["peers"]["flex_flash"] = peers.NOT_INSTALLED
    row.update({"pattern": "dense", "case": "dense", "seq_len": 8192, "variant": "gluon", "sparsegen_api_ms": 1.0,
                "sdpa_dense_ms": 1.1, "useful_tflop_s": 570.0})  # fmt: skip
    back = json.loads(json.dumps(row))
    assert back["peers"]["fa4"] == 0.868 and back["best_peer"] == "fa4"
    assert back["of_ceiling"]["flex_flash"] is None
    columns = SUMMARY_COLUMNS["prefill"]
    table = format_table([n for n, _ in columns], [[get(back) for _, get in columns]])
    header, line = table.splitlines()
    assert "fa4_ms" in header and "flex_flash_ms" in header and "x_best_peer" in header
    assert "n/a (flash_attn.cute not installed)" in line and "0.868" in line and "0.902" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, bench would run the benchmark")
def test_bench_options_parse_and_a_bad_case_is_refused_by_name():
    from click.testing import CliRunner

    from sparsegen.cli import cli

    ok = CliRunner().invoke(
        cli, ["bench", "--kind", "prefill", "--long", "--case", "gpt-oss", "--case", "dense"]
    )
    assert ok.exit_code == 1 and "needs a CUDA GPU" in ok.output, ok.output  # the options parsed
    bad = CliRunner().invoke(cli, ["bench", "--case", "gpt_oss"])
    assert bad.exit_code == 2 and "'gpt_oss' is not one of" in bad.output
