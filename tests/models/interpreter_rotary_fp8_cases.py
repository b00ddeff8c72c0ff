"""The fused rotary + KV-write kernel writing an fp8 cache with the layer's scales, in Triton's
interpreter on a CPU (run in a fresh process by tests/models/test_rotary_fp8_interpreter.py).

The interpreter's float -> fp8 conversion does not round as torch (and the GPU's cvt) do: it
rounds ties away from zero (-336 -> -352 in e4m3, torch -320) and drops the carry of a rounding
into the next binade (-125.6 -> -64, torch -128). So the bytes are compared with
`kv_scales.quantize`'s within one fp8 step, leaving out the values whose torch rounding carried
into a new binade (a few percent of them; the test bounds the share); saturation, the scale per
KV head, the slots and the untouched slots are exact. The GPU tier
(tests/kernels/test_rotary_fp8_gpu.py) holds every byte equal."""

from __future__ import annotations

import pytest
import torch

from sparsegen.errors import InputError
from sparsegen.models.kv_scales import KVScales, quantize
from sparsegen.models.rope import Rotary

pytestmark = pytest.mark.usefixtures("single_thread", "interpreter_env")


def _case(dtype, fp8, t, head_major):
    hkv, g, d, page = 2, 3, 16, 4
    gen = torch.Generator().manual_seed(7)
    qkv = (40 * torch.randn(t, hkv * (g + 2) * d, generator=gen)).to(dtype).view(t, hkv, g + 2, d)
    angles = torch.rand(t, d // 2, generator=gen) * 50
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    pages = -(-t // page) + 1
    if head_major:  # runner.kv_cache's head-major pages, viewed [pages, page, Hkv, D]
        cache = tuple(torch.zeros(pages, hkv, page, d, dtype=fp8).transpose(1, 2) for _ in range(2))
    else:
        cache = tuple(torch.zeros(pages, page, hkv, d, dtype=fp8) for _ in range(2))
    for c in cache:
        c.view(torch.uint8).fill_(0x7F)  # NaN in e4m3 and e5m2: untouched slots stay NaN
    slots = torch.randperm(pages * page, generator=gen)[:t]
    scales = KVScales(hkv, fp8, "cpu")
    top = torch.finfo(fp8).max
    scales.set(torch.tensor([1.0, 60.0]) / top, torch.tensor([40.0, 200.0]) / top)  # head 0's k saturates
    return qkv, cos, sin, cache, slots, scales, (hkv, g, d, pages, page)


MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _carried(want: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Where torch rounded x up into the next binade: want's mantissa is 0 and |x| < |want|."""
    bits = want.view(torch.uint8).int() & ((1 << MANTISSA_BITS[want.dtype]) - 1)
    return (bits == 0) & (x.abs() < want.float().abs())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t, tiled", [(7, False), (37, True)])
@pytest.mark.parametrize("head_major", [False, True])
def test_fused_rotary_writes_fp8_with_the_scales(fp8, dtype, t, tiled, head_major, monkeypatch):
    from sparsegen.kernels.fused import rotary as fused

    if tiled:
        monkeypatch.setattr(fused, "ROTARY_TILED_FROM", 1)
    qkv, cos, sin, cache, slots, scales, (hkv, g, d, pages, page) = _case(dtype, fp8, t, head_major)
    q, k, v = fused.rotary_qkv(qkv, cos, sin, cache, slots, scales)
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(k, Rotary.apply(qkv[:, :, g], cos, sin), **tol)  # q, k, v as without fp8
    assert torch.equal(v, qkv[:, :, g + 1])
    kc, vc = (c.reshape(pages * page, hkv, d) for c in cache)  # [slots, Hkv, D]
    for got, x, s in ((kc[slots], k, scales.k), (vc[slots], v, scales.v)):
        want = quantize(x, s, fp8)
        carried = _carried(want, x.float() / s[:, None])
        assert float(carried.float().mean()) < 0.1
        step = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()[~carried]
        assert int(step.max()) <= 1, int(step.max())  # a tie rounded the other way at most
        assert torch.isfinite(got.float()).all()  # saturated, never NaN
    top = torch.finfo(fp8).max
    assert (kc[slots][:, 0].float().abs() == top).any()  # head 0's k saturated to the largest value
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[slots] = False
    assert kc[untouched].float().isnan().all() and vc[untouched].float().isnan().all()


def test_fused_rotary_fp8_needs_its_scales():
    from sparsegen.kernels.fused import rotary as fused

    qkv, cos, sin, cache, slots, scales, (hkv, *_) = _case(torch.float32, torch.float8_e4m3fn, 5, False)
    with pytest.raises(InputError, match="needs scales="):
        fused.rotary_qkv(qkv, cos, sin, cache, slots)
    scales.k = torch.ones(hkv + 1)
    with pytest.raises(InputError, match=r"scales.k must be a float32 tensor \[2\]"):
        fused.rotary_qkv(qkv, cos, sin, cache, slots, scales)
    scales.k = torch.ones(hkv, dtype=torch.float16)
    with pytest.raises(InputError, match="scales.k must be a float32"):
        fused.rotary_qkv(qkv, cos, sin, cache, slots, scales)
    with pytest.raises(InputError, match="one fp8 dtype"):
        fused.rotary_qkv(qkv, cos, sin, (cache[0], cache[1].view(torch.float8_e5m2)), slots, scales)
    plain = tuple(torch.zeros(c.shape) for c in cache)
    with pytest.raises(InputError, match="only for an fp8 KV cache"):
        fused.rotary_qkv(qkv, cos, sin, plain, slots, scales)
