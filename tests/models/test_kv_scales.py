"""fp8 KV-cache arithmetic: the saturating quantised write, the dequantising gather, the amax
calibration, and a checkpoint's K/V scale tensors (vLLM's names) checked and read."""

from __future__ import annotations

import pytest
import torch

from sparsegen import reference
from sparsegen.models.config import CheckpointError
from sparsegen.models.kv_scales import (
    MIN_SCALE,
    KVScales,
    checked_scales,
    dequantize,
    fp8_max,
    quantize,
    scale_name,
)
from sparsegen.models.kv_write import read_kv, write_kv
from sparsegen.spec import HeadSpec, LayerSpec

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_fp8_max_is_the_formats_largest_finite_value():
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e5m2) == 57344.0


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_beyond_the_range_and_never_makes_nan(dtype):
    scale = torch.tensor([1.0, 0.5])  # [Hkv]
    x = torch.tensor([[[1e30, -1e30, float("inf"), -float("inf")], [1e6, -1e6, 3.0, 0.0]]])  # [1, 2, 4]
    q = quantize(x, scale, dtype)
    assert q.dtype == dtype
    top = fp8_max(dtype)
    got = q.float()
    assert torch.isfinite(got).all()
    assert got[0, 0].tolist() == [top, -top, top, -top]
    assert got[0, 1, :2].tolist() == [top, -top]
    assert got[0, 1, 2] == 6.0 and got[0, 1, 3] == 0.0  # 3 / 0.5, exactly representable


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_then_dequantize_is_within_the_formats_rounding(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * torch.tensor([1.0, 10.0, 0.01, 300.0])[:, None]  # [T, Hkv, D]
    s = KVScales(4, dtype, "cpu")
    s.calibrate(x, x)
    back = dequantize(quantize(x, s.k, dtype), s.k, torch.float32)
    mantissa = 3 if dtype == torch.float8_e4m3fn else 2
    # round-to-nearest: relative error <= 2**-(m+1) for normal values, plus the subnormal floor
    tol = 2.0 ** -(mantissa + 1) * x.abs() + s.k[:, None] * torch.finfo(dtype).smallest_normal
    assert ((back - x).abs() <= tol * 1.001).all()
    assert (back.abs() <= x.abs().amax(dim=(0, 2))[:, None] * 1.0001).all()  # amax maps to fp8_max


def test_calibrate_is_amax_over_fp8_max_per_head_clamped_and_ignores_inf():
    k = torch.zeros(3, 2, 4)
    k[1, 0, 2] = -896.0
    k[2, 0, 0] = float("inf")  # saturates when written; does not set the scale
    v = torch.ones(3, 2, 4) * 44.8
    s = KVScales(2, torch.float8_e4m3fn, "cpu")
    k_before, v_before = s.k.data_ptr(), s.v.data_ptr()
    s.calibrate(k, v)
    assert s.ready
    assert torch.equal(s.k, torch.tensor([2.0, MIN_SCALE]))  # 896 / 448; an all-zero head: MIN_SCALE
    assert torch.allclose(s.v, torch.tensor([0.1, 0.1]))
    assert (s.k.data_ptr(), s.v.data_ptr()) == (k_before, v_before)  # in place: graphs keep the address


@pytest.mark.parametrize("layout", ["head", "token"])
def test_write_then_gather_dequantises_to_the_model_dtype(layout):
    from sparsegen.runner.kv_cache import KVCache

    cache = KVCache(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
                    dtype=torch.float8_e4m3fn, device="cpu", layout=layout)  # fmt: skip
    kc, vc, scales = cache.layers[0]
    assert kc.dtype == torch.float8_e4m3fn and scales is not None
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen) * 5
    scales.calibrate(k, v)
    slots = cache.slots([2, 0], 0, 6)
    write_kv(kc, vc, slots, k, v, scales)
    gather = torch.stack([torch.div(slots, 4, rounding_mode="floor"), slots % 4])  # [2, 6]
    k_back = read_kv(kc, gather, scales.k, torch.float32)
    v_back = read_kv(vc, gather, scales.v, torch.float32)
    assert k_back.dtype == torch.float32
    assert torch.allclose(k_back, k, rtol=2**-4, atol=1e-6) and torch.allclose(
        v_back, v, rtol=2**-4, atol=1e-5
    )
    assert not torch.equal(k_back, k)  # it did go through fp8


def test_huge_keys_saturate_in_the_cache_and_decode_stays_finite():
    """Keys 1e30 written with a scale of 1: the cache holds ±448, the reference decode over it is finite."""
    from sparsegen.runner.kv_cache import KVCache

    cache = KVCache(num_layers=1, num_pages=3, page_size=4, num_kv_heads=1, head_dim=32,
                    dtype=torch.float8_e4m3fn, device="cpu")  # fmt: skip
    kc, vc, scales = cache.layers[0]
    scales.set(torch.tensor(1.0), torch.tensor(1.0))
    k = torch.full((4, 1, 32), 1e30)
    k[::2] *= -1
    v = torch.randn(4, 1, 32) * 1e30
    write_kv(kc, vc, cache.slots([0], 0, 4), k, v, scales)
    assert kc[0].float().abs().max() == 448.0 and torch.isfinite(kc.float()).all()
    layer = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=32, heads=(HeadSpec(dense=True),) * 2)
    q = torch.randn(1, 2, 32)
    out = reference.paged_decode(q, kc, vc, torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                                 layer, k_scale=scales.k, v_scale=scales.v)  # fmt: skip
    assert torch.isfinite(out).all()


def test_scale_names_are_vllms():
    assert scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert scale_name("model.layers.12.self_attn.v_scale") == (12, "v")
    assert scale_name("model.layers.3.self_attn.k_proj.weight") is None
    assert scale_name("model.layers.3.self_attn.q_scale") is None


def test_checked_scales_accepts_scalar_one_and_per_head():
    got = checked_scales({(0, "k"): torch.tensor(0.5), (0, "v"): torch.tensor([0.25]),
                          (1, "k"): torch.tensor([1.0, 2.0]), (1, "v"): torch.tensor([3.0, 4.0], dtype=torch.bfloat16)},
                         2, 2, "ckpt")  # fmt: skip
    assert got[0][0].shape == () and got[0][1].shape == () and got[0][1] == 0.25
    assert got[1][1].dtype == torch.float32 and got[1][1].tolist() == [3.0, 4.0]


@pytest.mark.parametrize(
    "found, match",
    [
        ({(0, "k"): torch.tensor(1.0)}, "not 'model.layers.0.self_attn.v_scale'"),
        ({(0, "k"): torch.tensor([1.0, 1.0, 1.0]), (0, "v"): torch.tensor(1.0)}, "one per KV head"),
        ({(0, "k"): torch.tensor(0.0), (0, "v"): torch.tensor(1.0)}, "finite and > 0"),
        ({(0, "k"): torch.tensor(float("nan")), (0, "v"): torch.tensor(1.0)}, "finite and > 0"),
        ({(0, "k"): torch.tensor(1, dtype=torch.int32), (0, "v"): torch.tensor(1.0)}, "float scalar"),
        ({(5, "k"): torch.tensor(1.0), (5, "v"): torch.tensor(1.0)}, "layer 5"),
    ],
)
def test_checked_scales_refuses_bad_scales(found, match):
    with pytest.raises(CheckpointError, match=match):
        checked_scales(found, 2, 2, "ckpt")
