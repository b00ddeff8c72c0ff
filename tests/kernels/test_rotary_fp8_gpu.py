"""GPU tier (`pytest -m gpu`): the fused rotary + KV-write kernel writes an fp8 cache byte for
byte as the torch path does (`models.kv_scales.quantize` of the rotated k and of v, with the
layer's per-KV-head scales, saturating), for e4m3 and e5m2, bf16 and fp16 models, a token per
program and tiled, token- and head-major pages."""

from __future__ import annotations

import pytest
import torch

from sparsegen.kernels.fused import rotary as fused
from sparsegen.models.kv_scales import KVScales, quantize
from sparsegen.models.rope import Rotary

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 32, 1500])  # 1500 >= ROTARY_TILED_FROM: 16 tokens a program
@pytest.mark.parametrize("head_major", [False, True])
def test_fused_rotary_fp8_bytes_equal_the_torch_path(fp8, dtype, t, head_major):
    hkv, g, d, page = 8, 4, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(t)
    qkv = (8 * torch.randn(t, hkv, g + 2, d, device="cuda", generator=gen)).to(dtype)
    angles = torch.rand(t, d // 2, device="cuda", generator=gen) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    pages = -(-t // page) + 2
    shape = (pages, hkv, page, d) if head_major else (pages, page, hkv, d)
    cache = tuple(torch.empty(shape, dtype=fp8, device="cuda") for _ in range(2))
    if head_major:
        cache = tuple(c.transpose(1, 2) for c in cache)  # viewed [pages, page, Hkv, D]
    for c in cache:
        c.view(torch.uint8).fill_(0x7F)  # NaN: untouched slots stay NaN
    slots = torch.randperm(pages * page, device="cuda", generator=gen)[:t]
    scales = KVScales(hkv, fp8, "cuda")
    top = torch.finfo(fp8).max
    scales.set(torch.linspace(2.0, 40.0, hkv) / top, torch.linspace(4.0, 30.0, hkv) / top)  # some saturate
    q, k, v = fused.rotary_qkv(qkv, cos, sin, cache, slots, scales)
    torch.testing.assert_close(k, Rotary.apply(qkv[:, :, g], cos, sin))
    kc, vc = (c.reshape(pages * page, hkv, d) for c in cache)  # [slots, Hkv, D]
    for name, got, x, s in (("k", kc[slots], k, scales.k), ("v", vc[slots], v, scales.v)):
        want = quantize(x, s, fp8)
        bad = got.view(torch.uint8) != want.view(torch.uint8)
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} of {bad.numel()} bytes differ, e.g. got {got[bad][:4].float().tolist()} "
            f"for {want[bad][:4].float().tolist()} from {(x.float() / s[:, None])[bad][:4].tolist()}"
        )
    untouched = torch.ones(pages * page, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert kc[untouched].float().isnan().all() and vc[untouched].float().isnan().all()
