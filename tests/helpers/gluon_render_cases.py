"""A fixed set of Gluon prefill render cases (spec, config overrides, dtype) for head_dim 64 and 128,
whose rendered sources are pinned by SHA-256 (first 16 hex digits) in tests/kernels/golden/prefill_gluon_render_sha256.json: the
kernels measured on the H200 (and their cache keys) must not change when the template grows a path
for another head_dim. After a deliberate template change: python tests/kernels/golden/regenerate.py"""

from __future__ import annotations

import hashlib

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.kernels import prefill_gluon_template as tpl

CONFIGS = {
    "rule": {},
    "persistent3": {"persistent": True, "programs": 3},
    "pingpong": {"pingpong": True},
    "kv_major": {"kv_major": True},
    "n64": {"block_n": 64, "stages": 3, "vpair": False},
    "n128_s2_vpair": {"block_n": 128, "stages": 2, "vpair": True},
    "q_smem": {"q_smem": True},
    "one_consumer": {"consumers": 1},
}
_VS = dict(block_size=64, local_blocks=2, vert_stride=4)
HEADS = {
    "local": (HeadSpec(block_size=64, local_blocks=3),) * 4,
    "window": (HeadSpec(block_size=64, sliding_window=333),) * 4,
    "vert_affine": tuple(HeadSpec(**_VS, vert_offset=h % 4) for h in range(4)),
    "vert_chain": tuple(HeadSpec(**_VS, vert_offset=o) for o in (3, 0, 2, 2)),
    "hybrid": (
        HeadSpec(dense=True),
        HeadSpec(block_size=64, local_blocks=1, sliding_window=100),
        HeadSpec(block_size=128, local_blocks=2, vert_stride=3, vert_offset=1),
        HeadSpec(block_size=64, sliding_window=5000),
    ),
}


def layers() -> dict[str, LayerSpec]:
    out = {}
    for d in (64, 128):
        for name, heads in HEADS.items():
            for kv in (1, 2, 4):
                out[f"{name}_hd{d}_kv{kv}"] = LayerSpec(num_heads=4, num_kv_heads=kv, head_dim=d, heads=heads)
    for preset in ("phi3small", "phi3small-128k", "sliding-window", "dense"):
        for i, layer in enumerate(sparsegen.get_pattern(preset).layers[:2]):
            out[f"{preset}_{i}"] = layer
    return out


def digests() -> dict[str, str]:
    """Case name -> SHA-256 (16 hex digits) of its rendered source ("refused: ..." where config() refuses it)."""
    out = {}
    for lname, layer in layers().items():
        for cname, overrides in CONFIGS.items():
            try:
                cfg = tpl.config(layer, **overrides)
            except sparsegen.InputError as exc:
                out[f"{lname}/{cname}"] = f"refused: {exc}"
                continue
            for dtype in ("bf16", "fp16"):
                source = tpl.render_source(layer, dtype, cfg)
                out[f"{lname}/{cname}/{dtype}"] = hashlib.sha256(source.encode()).hexdigest()[:16]
    return out
