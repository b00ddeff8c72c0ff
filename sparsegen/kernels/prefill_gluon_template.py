"""The Gluon (sm_90) prefill template's constants: which specs it covers, its tile shape, its paths.

`covers(layer, dtype)` says whether the Hopper kernel handles a layer (else the tl kernel does);
`plan(layer, dtype)` turns a `LayerSpec` into the typed constants of
`templates/prefill_gluon.py.jinja` (which includes its key-tile schedule,
`prefill_gluon_schedule.py.jinja`), one "path" per distinct head pattern, and `render_source`
renders it. The key-tile schedule the template computes is mirrored, as a pure function, in
`gluon_schedule.py`. The layer features render only where a layer has them (`FEATURES`): soft-cap
(tanh.approx on the scaled fp32 scores, before the mask), learned sinks (one more term of the
final denominator) and sink tokens (key tiles from key 0 below the near range); a layer without
them renders exactly as before.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..jit.render import render
from ..spec import HeadSpec, LayerSpec
from .prefill_template import _affine_offsets, _ranges  # one head-grouping rule for both variants

TEMPLATE = "prefill_gluon.py.jinja"
# The tile shape, by rule (never autotuned, so the key pins it): 128 query rows per program,
# shared by `consumers` consumer partitions (warpgroups), one producer warp at 24 registers; the
# rest of the 168 x 12 warps register file goes to the consumers (setmaxnreg).
CONFIG = {
    "block_m": 128,
    "block_n": 64,
    "stages": 3,
    "consumers": 2,
    "persistent": False,  # True: one program per SM loops over the work items (see config())
    "programs": 0,  # persistent grid size; 0 = the GPU's SM count (tests force a small one)
    "q_smem": False,
    "pingpong": False,  # the two consumers take turns issuing their matmuls (FA3's inter-warpgroup overlap)
    "kv_major": False,  # work items KV head by KV head (L2 reuse of its rows) instead of tile by tile
    "vpair": False,  # key tiles of two block_n/2-key TMA boxes: two vertical chunks, or one near tile
    "producer_regs": 24,
    "consumer_regs": 240,
    "maxnreg": 168,
}
# head_dims 64, 128 and 256 run in tiles of their own width; every other multiple of 16 from 48 to
# 240 runs in the next power of two's tiles (Gluon shapes are powers of two), its K/V read through
# 3-D TMA descriptors whose zero fill pads each head's row (prefill_gluon._heads). 64 and 128 render
# exactly as before, so their keys and H200-measured kernels are unchanged. head_dim 32 goes to the
# tl kernel (a 32-wide tile is untested here). Dropping a size from HEAD_DIMS sends it to tl.
HEAD_DIMS = tuple(range(48, 257, 16))
FEATURES = frozenset({"sink_tokens", "logit_softcap", "learned_sinks"})  # what the template implements
# Shared memory per block on sm_90 (227 KB): the Q tiles (q_smem) and the K/V ring must fit.
SMEM_LIMIT = 232448


def tile_dim(head_dim: int) -> int:
    """The width of a head_dim's register and shared-memory tiles: the next power of two."""
    return 1 << (head_dim - 1).bit_length()


VERTICAL_BLOCK_N = 64  # the key chunk of layers with vertical-stride heads (config(): two per tile)
# Each distinct head pattern is a branch of the schedule and of the masked softmax, so build time
# grows with their number (CPU, AOT: 8 patterns ~1.4x the build of 1, 32 patterns ~5x); layers with
# more go to the tl kernel, whose build is flat in the number of distinct heads.
MAX_PATHS = 8
# In 256-wide tiles O alone takes 128 of a consumer thread's 240 registers. ptxas (sm_90) spills
# 16-24 bytes with 2 or more distinct head patterns once there are layer features or a vertical-
# stride pattern, and with 4 patterns without either; one pattern (dense, window, local, vertical,
# with every feature) builds without spills. So 256-wide tiles take one head pattern; layers with
# more go to the tl kernel (the models with head_dim 256, Gemma-2/3, have one per layer). In
# 128-wide tiles today's kernels spill too (4 bytes on hd 128 dense causal, ~700 bytes with 4
# head patterns), with or without the features; those stay as they were measured.
MAX_PATHS_WIDE = 1
DTYPES = ("bf16", "fp16")


def config(layer: LayerSpec, **overrides: Any) -> dict[str, Any]:
    """The tile shape and launch shape for `layer` (overrides are for benchmarks)."""
    cfg = dict(CONFIG)
    vertical = any(h.vert_stride and not h.dense for h in layer.heads)
    # The rule, from interleaved sweeps on the H200 (benchmarks/prefill/bench_prefill_gluon.py
    # --variants, docs/performance.md): 128-key tiles with 3 stages for every layer (dense 32K
    # 15.66 -> 14.61 ms, window 4096 at 32K 3.87 -> 3.63 ms against 64-key tiles); layers with
    # vertical-stride heads build each tile from two 64-key chunks (`vpair`: their vertical blocks
    # are 64 tokens), one program per work item, KV-head-major order (64-key tiles in that order:
    # phi3small 32K 3.18 -> 2.98 ms against the persistent tile-major grid); dense layers in
    # KV-head-major order too (32K 14.61 -> 13.81 ms: 1.09x SDPA in that run).
    if tile_dim(layer.head_dim) == 256:
        # 256-wide tiles: Q in shared memory (2 x 32 KB: in registers it would take 64 of each
        # consumer thread's registers beside O's 128), 64-key tiles in a 2-stage ring (4 x 32 KB):
        # 192 KB of the 227 KB; vertical blocks (>= 64 keys) are whole 64-key tiles.
        cfg.update(block_n=64, stages=2, q_smem=True, vpair=False, kv_major=all(h.dense for h in layer.heads))
    elif vertical:
        cfg.update(block_n=128, stages=3, vpair=True, persistent=False, kv_major=True)
    else:
        cfg.update(block_n=128, stages=3, q_smem=False, kv_major=all(h.dense for h in layer.heads))
    cfg.update(overrides)
    smem = smem_bytes(layer, cfg)
    if smem > SMEM_LIMIT:
        raise InputError(
            f"the Gluon prefill tiles need {smem} bytes of shared memory at head_dim {layer.head_dim} "
            f"(block_n {cfg['block_n']}, stages {cfg['stages']}, q_smem {bool(cfg['q_smem'])}); "
            f"sm_90 has {SMEM_LIMIT}"
        )
    chunk = cfg["block_n"] // 2 if cfg["vpair"] else cfg["block_n"]
    for h, head in enumerate(layer.heads):
        if head.vert_stride and not head.dense and head.block_size % chunk:
            raise InputError(
                f"a key chunk of {chunk} does not divide head {h}'s vertical blocks of "
                f"{head.block_size} tokens (a key tile covers whole vertical blocks)"
            )
    cfg["wg_warps"] = 4 * (2 // cfg["consumers"])  # warps per consumer partition
    cfg["num_warps"] = 4 if cfg["consumers"] == 2 else 8  # the default partition's warps
    return cfg


def smem_bytes(layer: LayerSpec, cfg: dict[str, Any]) -> int:
    """Shared memory of the K/V ring and (q_smem) the Q tiles, 2 bytes an element; barriers and
    the compiler's scratch come on top (the AOT tests read the built kernel's own figure)."""
    width = tile_dim(layer.head_dim)
    q = cfg["block_m"] * width * 2 if cfg["q_smem"] else 0
    return q + cfg["stages"] * 2 * cfg["block_n"] * width * 2


def covers(layer: LayerSpec, dtype: str) -> str | None:
    """None when the Gluon kernel handles `layer` in `dtype`, else the reason it does not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (the Gluon kernel is bf16/fp16)"
    if layer.head_dim not in HEAD_DIMS:
        return f"head_dim {layer.head_dim} (the Gluon kernel covers {HEAD_DIMS[0]}..{HEAD_DIMS[-1]})"
    for h, head in enumerate(layer.heads):
        if head.sink_tokens and head.vert_stride:
            return (
                f"head {h}: sink tokens on a vertical-stride head (the Gluon schedule puts sink tiles "
                "in the vertical tiles' slots)"
            )
    n_paths = len({_path_key(head) for head in layer.heads})
    if n_paths > MAX_PATHS:
        return f"{n_paths} distinct head patterns (the Gluon kernel takes up to {MAX_PATHS})"
    if tile_dim(layer.head_dim) == 256 and n_paths > MAX_PATHS_WIDE:
        return (
            f"{n_paths} distinct head patterns at head_dim {layer.head_dim} (in 256-wide tiles the Gluon "
            f"kernel takes {MAX_PATHS_WIDE}: more spill registers)"
        )
    for h, head in enumerate(layer.heads):
        if head.vert_stride and not head.dense and head.block_size % VERTICAL_BLOCK_N:
            return (
                f"head {h}: vertical blocks of {head.block_size} tokens are narrower than the "
                f"{VERTICAL_BLOCK_N}-key tile"
            )
    return None


def _path_key(head: HeadSpec) -> tuple:
    """Heads that share everything but the vertical offset share one path."""
    if head.dense:
        return ("dense",)
    key = (head.kind, head.block_size, head.local_blocks, head.vert_stride, head.sliding_window)
    return key + (head.sink_tokens,) if head.sink_tokens else key


def paths(layer: LayerSpec) -> list[dict[str, Any]]:
    groups: dict[tuple, list[int]] = {}
    for h, head in enumerate(layer.heads):
        groups.setdefault(_path_key(head), []).append(h)
    out = []
    for pid, heads in enumerate(groups.values()):
        spec = layer.heads[heads[0]]
        offsets = [layer.heads[h].vert_offset for h in heads]
        vert = 0 if spec.dense else spec.vert_stride
        affine = _affine_offsets(heads, offsets, vert) if vert else None
        out.append(
            {
                "id": pid,
                "kind": spec.kind,
                "dense": spec.dense,
                "bs": spec.block_size,
                "local": 0 if spec.dense else spec.local_blocks,
                "vert": vert,
                "window": 0 if spec.dense else spec.sliding_window,
                "ranges": _ranges(heads),
                "affine": affine is not None,
                "off_a": affine[0] if affine else 0,
                "off_c": affine[1] if affine else 0,
                "offsets": [[h, o] for h, o in zip(heads, offsets)],
                "sink": 0 if spec.dense else spec.sink_tokens,
            }
        )
    return out


def plan(layer: LayerSpec, dtype: str, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """The template's constants (the caller checked `covers` first)."""
    cfg = cfg or config(layer)
    return {
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "tile_d": tile_dim(layer.head_dim),
        "group": layer.group_size,
        "dtype": dtype,
        **{
            k: cfg[k] for k in ("block_m", "block_n", "stages", "consumers", "wg_warps", "q_smem", "kv_major")
        },
        "pingpong": cfg["pingpong"] and cfg["consumers"] == 2,
        "vpair": cfg["vpair"],
        **{k: cfg[k] for k in ("producer_regs", "consumer_regs")},
        "paths": paths(layer),
        # layer features (templates take typed constants only: the cap as an exact ratio of ints)
        "softcap": bool(layer.logit_softcap),
        "softcap_ratio": list(float(layer.logit_softcap).as_integer_ratio()),
        "learned_sinks": layer.learned_sinks,
        "sink_tok": any(head.sink_tokens for head in layer.heads),
    }


def render_source(layer: LayerSpec, dtype: str, cfg: dict[str, Any] | None = None) -> str:
    return render(TEMPLATE, **plan(layer, dtype, cfg))
