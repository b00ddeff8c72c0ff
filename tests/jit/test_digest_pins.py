"""Literal pins of the spec digest and of one prefill and one decode cache key.

Every kernel cache entry is named by these hashes: if one changes, every cache built before it is
orphaned (rebuilt on first use). A change must therefore be deliberate: a new canonical spec form,
a template change (the goldens in tests/golden/ change with it) or a new key field. Update the
literal here in the same commit and say why. The keys are computed with fixed toolchain versions,
so the pins hold whatever torch, Triton or NVRTC is installed.
"""

from __future__ import annotations

import pytest

import sparsegen
from sparsegen.jit import cache
from sparsegen.kernels import base

PHI3SMALL_DIGEST = "eecccfffc5a3db9ad78ff9de8a69817c162384c1ce4a2a34ff62b2a676a30d54"
PHI3SMALL_LAYER0_DIGEST = "16501791f9051564b42ec9948420b4e063e7d6c389b0a4e18de472bd2575f639"
FIXED_VERSIONS = {"cache_format": "1", "torch": "2.0.0-pin", "triton": "3.0.0-pin", "nvrtc": "12.0-pin"}
KEYS = {  # (kind, variant, page_size) of phi3small's layer 0 in bf16 for sm_90 -> entry name
    ("prefill", "tl", None): "prefill_bf16_hd128_h32kv8_bs64_l16_v8-8ce68212500480152af255e7",
    ("prefill", "gluon", None): "prefill_gluon_bf16_hd128_h32kv8_bs64_l16_v8-aa2bdb76a999ff3815d0280f",
    ("decode", "cuda", 16): "decode_bf16_hd128_ps16_g4_bs64_l16_v8-21ba93663bf4abdd531036cd",
}


def test_phi3small_spec_digest_is_pinned():
    model = sparsegen.get_pattern("phi3small")
    assert model.digest() == PHI3SMALL_DIGEST
    assert model.layers[0].digest() == PHI3SMALL_LAYER0_DIGEST


@pytest.mark.parametrize("kind,variant,page_size", list(KEYS))
def test_cache_keys_are_pinned(kind, variant, page_size, monkeypatch):
    assert set(FIXED_VERSIONS) == set(cache.toolchain_versions())  # the pin covers every version field
    monkeypatch.setattr(cache, "toolchain_versions", lambda: dict(FIXED_VERSIONS))
    layer = sparsegen.get_pattern("phi3small").layers[0]
    request = base.KernelRequest.make(
        kind, layer, dtype="bf16", arch="sm_90", page_size=page_size, variant=variant
    )
    assert base.key_of(request).key.key == KEYS[kind, variant, page_size]
