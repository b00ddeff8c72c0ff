"""The attention features of DESIGN §1 beyond the pattern: sink tokens, logit soft-cap, learned
sinks, the layer's own scale, head_dim 32..256 and fp8 K/V with scales. The reference is held to
a per-pair Python oracle written from the definitions; the spec and the argument checks to
their typed errors."""

from __future__ import annotations

import math

import pytest
import torch

import sparsegen
from sparsegen import reference
from sparsegen.errors import ImplUnavailableError, InputError, SpecError
from sparsegen.layout import block_mask, density, visible_counts, visible_mask
from sparsegen.spec import HeadSpec, LayerSpec


def _sees(head: HeadSpec, i: int, j: int) -> bool:
    """Query i sees key j: the definitions of DESIGN §1, one pair at a time."""
    if j > i:
        return False
    if head.dense:
        return True
    b = head.block_size
    return (
        (head.local_blocks and i // b - j // b < head.local_blocks)
        or (head.vert_stride and (j // b + head.vert_offset + 1) % head.vert_stride == 0)
        or (head.sliding_window and i - j < head.sliding_window)
        or j < head.sink_tokens
    )


def _oracle(q, k, v, layer: LayerSpec, scale: float, sinks=None, k_scale=None, v_scale=None):
    """[n, H, D] float64 attention of one sequence whose queries are its last n keys."""
    n_q, n_k = q.shape[0], k.shape[0]
    out = torch.zeros(n_q, layer.num_heads, layer.head_dim, dtype=torch.float64)
    for h in range(layer.num_heads):
        g = layer.kv_head(h)
        ks = 1.0 if k_scale is None else float(k_scale.reshape(-1)[g if k_scale.dim() else 0])
        vs = 1.0 if v_scale is None else float(v_scale.reshape(-1)[g if v_scale.dim() else 0])
        for r in range(n_q):
            i = n_k - n_q + r
            js = [j for j in range(n_k) if _sees(layer.heads[h], i, j)]
            s = [scale * float(q[r, h].double() @ (k[j, g].double() * ks)) for j in js]
            c = layer.logit_softcap
            if c:
                s = [c * math.tanh(x / c) for x in s]
            top = max(s + ([float(sinks[h])] if sinks is not None else []))
            w = [math.exp(x - top) for x in s]
            denom = sum(w) + (math.exp(float(sinks[h]) - top) if sinks is not None else 0.0)
            for wj, j in zip(w, js):
                out[r, h] += wj / denom * v[j, g].double() * vs
    return out


def _layer(head_dim=32, softcap=0.0, learned=False, sink_tokens=3, scale=None):
    heads = (
        HeadSpec(block_size=16, sliding_window=4, sink_tokens=sink_tokens),
        HeadSpec(block_size=16, local_blocks=1, vert_stride=2, sink_tokens=sink_tokens),
        HeadSpec(dense=True),
        HeadSpec(block_size=16, sliding_window=7),
    )
    return LayerSpec(4, 2, head_dim, heads, logit_softcap=softcap, learned_sinks=learned, scale=scale)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("learned", [False, True])
def test_reference_prefill_matches_the_oracle(softcap, learned):
    g = torch.Generator().manual_seed(1)
    layer = _layer(softcap=softcap, learned=learned, scale=0.3)
    n_k, n_q = 37, 21
    q = torch.randn(n_q, 4, 32, generator=g, dtype=torch.float64) * 3  # large logits: the cap bites
    k = torch.randn(n_k, 2, 32, generator=g, dtype=torch.float64)
    v = torch.randn(n_k, 2, 32, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g) * 2 if learned else None
    cu_q, cu_k = torch.tensor([0, n_q], dtype=torch.int32), torch.tensor([0, n_k], dtype=torch.int32)
    got = reference.prefill(q, k, v, cu_q, cu_k, layer, sinks=sinks)
    want = _oracle(q, k, v, layer, 0.3, sinks)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_learned_sinks_only_shrink_the_weights():
    layer = _layer(learned=True, sink_tokens=0)
    q, k, v = torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.ones(5, 2, 32)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    # v = 1 everywhere: without a sink each output is 1; a sink of logit s lowers it below 1
    out = reference.prefill(q, k, v, cu, cu, layer, sinks=torch.full((4,), 3.0))
    assert (out < 1).all() and (out > 0).all()
    out = reference.prefill(q, k, v, cu, cu, layer, sinks=torch.full((4,), -80.0))
    torch.testing.assert_close(out, torch.ones_like(out))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_head", [True, False])
def test_reference_decode_dequantises_fp8_pages(fp8, per_head):
    g = torch.Generator().manual_seed(2)
    layer = _layer(head_dim=48, sink_tokens=2)
    pages, ps = 6, 8
    k_cache = (torch.randn(pages, ps, 2, 48, generator=g) * 4).to(fp8)
    v_cache = (torch.randn(pages, ps, 2, 48, generator=g) * 4).to(fp8)
    k_scale = torch.tensor([0.5, 0.25]) if per_head else torch.tensor(0.125)
    v_scale = torch.tensor([2.0, 0.75]) if per_head else torch.tensor(1.5)
    q = torch.randn(2, 4, 48, generator=g)
    tables = torch.tensor([[5, 0, 3, 1], [2, 4, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([29, 9], dtype=torch.int32)
    got = reference.paged_decode(q, k_cache, v_cache, tables, lens, layer, k_scale=k_scale, v_scale=v_scale)
    for b, n in enumerate(lens.tolist()):
        k = reference.gather_pages(k_cache, tables[b], n).float()
        v = reference.gather_pages(v_cache, tables[b], n).float()
        want = _oracle(q[b : b + 1], k, v, layer, layer.default_scale, None, k_scale, v_scale)[0]
        torch.testing.assert_close(got[b].double(), want, rtol=2e-5, atol=2e-5)


def test_layout_counts_sink_tokens_exactly():
    layer = _layer()
    n = 45
    mask = visible_mask(layer, n)
    for h, head in enumerate(layer.heads):
        want = torch.tensor([[_sees(head, i, j) for j in range(n)] for i in range(n)])
        assert torch.equal(mask[h], want)
    assert torch.equal(mask.sum(-1), visible_counts(layer, torch.arange(n)))
    torch.testing.assert_close(density(layer, n), mask.sum((1, 2)).double() / (n * (n + 1) / 2))
    tiles = block_mask(layer, n, 16)
    padded = torch.nn.functional.pad(mask, (0, 3, 0, 3)).view(4, 3, 16, 3, 16)
    assert torch.equal(tiles, padded.any(4).any(2))


def test_defaults_keep_the_canonical_json_and_the_new_fields_round_trip():
    plain = LayerSpec(2, 1, 64, (HeadSpec(sliding_window=8),) * 2)
    assert set(plain.to_dict()) == {"num_heads", "num_kv_heads", "head_dim", "heads"}
    assert "sink_tokens" not in plain.to_dict()["heads"][0]
    full = _layer(head_dim=256, softcap=50, learned=True, scale=0.0625)
    assert LayerSpec.from_json(full.to_json()) == full
    assert full.features == ("sink_tokens", "logit_softcap", "learned_sinks")
    assert full.heads[0].kind == "window+sink" and full.default_scale == 0.0625
    assert full.digest() != _layer(head_dim=256, softcap=50, learned=True).digest()
    assert HeadSpec(dense=True, sink_tokens=4).sink_tokens == 0  # a dense head sees them anyway


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_softcap": -1.0}, "logit_softcap"),
        ({"logit_softcap": float("nan")}, "logit_softcap"),
        ({"logit_softcap": 1e-9}, "logit_softcap"),
        ({"logit_softcap": True}, "logit_softcap"),
        ({"logit_softcap": "50"}, "logit_softcap"),
        ({"learned_sinks": 1}, "learned_sinks"),
        ({"scale": 0.0}, "scale"),
        ({"scale": float("inf")}, "scale"),
        ({"scale": "0.1"}, "scale"),
        ({"head_dim": 40}, "head_dim"),
        ({"head_dim": 16}, "head_dim"),
        ({"head_dim": 272}, "head_dim"),
    ],
)
def test_bad_layer_fields_name_the_field(kwargs, field):
    args = {"num_heads": 1, "num_kv_heads": 1, "head_dim": 64, "heads": (HeadSpec(dense=True),), **kwargs}
    with pytest.raises(SpecError, match=field):
        LayerSpec(**args)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3", None])
def test_bad_sink_tokens_are_refused(bad):
    with pytest.raises(SpecError, match="sink_tokens"):
        HeadSpec(sliding_window=4, sink_tokens=bad)


def _prefill_args(layer, fp8=None):
    q = torch.randn(3, layer.num_heads, layer.head_dim)
    k = torch.randn(3, layer.num_kv_heads, layer.head_dim)
    v = torch.randn(3, layer.num_kv_heads, layer.head_dim)
    if fp8 is not None:
        k, v = k.to(fp8), v.to(fp8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    return q, k, v, cu, cu


@pytest.mark.parametrize(
    ("learned", "fp8", "kwargs", "match"),
    [
        (True, None, {}, "learned_sinks=True: pass sinks="),
        (False, None, {"sinks": torch.zeros(4)}, "learned_sinks=False"),
        (True, None, {"sinks": torch.zeros(3)}, r"sinks must have shape \[4\]"),
        (True, None, {"sinks": torch.zeros(4, dtype=torch.float64)}, "sinks must be float32"),
        (True, None, {"sinks": torch.tensor([0.0, float("nan"), 0, 0])}, "sinks must be finite"),
        (True, None, {"sinks": [0.0] * 4}, "sinks must be a torch.Tensor"),
        (False, torch.float8_e4m3fn, {}, "pass k_scale="),
        (False, torch.float8_e4m3fn, {"k_scale": torch.ones(2)}, "pass v_scale="),
        (False, None, {"k_scale": torch.ones(2)}, "only for fp8"),
        (
            False,
            torch.float8_e4m3fn,
            {"k_scale": torch.ones(3), "v_scale": torch.ones(2)},
            "k_scale must have",
        ),
        (False, torch.float8_e4m3fn, {"k_scale": torch.zeros(2), "v_scale": torch.ones(2)}, "finite and > 0"),
        (
            False,
            torch.float8_e4m3fn,
            {"k_scale": torch.ones(2), "v_scale": -torch.ones(())},
            "finite and > 0",
        ),
    ],
)
def test_feature_tensors_are_checked_before_anything_runs(learned, fp8, kwargs, match):
    layer = _layer(learned=learned)
    with pytest.raises(InputError, match=match):
        sparsegen.prefill(*_prefill_args(layer, fp8), layer, **kwargs)


def test_mixed_fp8_kv_dtypes_are_refused():
    layer = _layer()
    q, k, v, cu, _ = _prefill_args(layer, torch.float8_e4m3fn)
    with pytest.raises(InputError, match="v has dtype"):
        sparsegen.prefill(
            q, k, v.to(torch.float8_e5m2), cu, cu, layer, k_scale=torch.ones(2), v_scale=torch.ones(2)
        )


def test_kernels_refuse_features_they_do_not_implement(monkeypatch):
    from sparsegen.kernels.families.decode import CudaDecode

    monkeypatch.setattr(CudaDecode, "features", frozenset())  # the decode family implements soft-cap
    layer = _layer(head_dim=64, softcap=30.0)
    with pytest.raises(ImplUnavailableError, match="logit_softcap"):
        sparsegen.get_kernel(layer, "decode", dtype=torch.float16, arch="sm_90")


def test_the_layer_scale_is_the_default_and_a_call_scale_wins():
    layer = _layer(scale=0.5, sink_tokens=0)
    q, k, v, cu, _ = _prefill_args(layer)
    default = sparsegen.prefill(q, k, v, cu, cu, layer)
    torch.testing.assert_close(default, sparsegen.prefill(q, k, v, cu, cu, layer, 0.5))
    assert not torch.allclose(default, sparsegen.prefill(q, k, v, cu, cu, layer, 0.1))
