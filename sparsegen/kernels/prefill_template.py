"""What the Triton prefill template receives for a layer spec, and the rendered module.

Mirrors `decode_template.py`. `template_constants(layer, config)` turns a `LayerSpec` into the
typed constants of `templates/prefill_triton.py.jinja`; `render_source` renders them.

Heads of one *kind* (which parts are on: dense, local, vert, window) and one block size share
one code path (`_path_<id>` in the module), so the compiled code grows with the number of kinds,
not with the number of distinct heads. Inside a path each per-head number (local blocks,
vertical stride and offset, window) is either a literal, when every head of the path agrees
(a uniform layer such as phi3small stays fully constant-folded), or a scalar selected once per
program from `h` by a short chain of `tl.where` over head ranges: no table in memory.

Naming vocabulary, shared with the decode template: the spec's field names (`block_size`,
`local_blocks`, `vert_stride`, `vert_offset`, `sliding_window`), `head_dim` / `head_dim_pow2`,
`block_m` / `block_n` for tile sizes; `group_size` for query heads per KV head.
"""

from __future__ import annotations

from typing import Any

from ..env import parse_arch
from ..jit.render import render
from ..spec import LayerSpec
from .naming import path_key, pattern_name

TEMPLATE = "prefill_triton.py.jinja"
KERNEL_FN = "prefill_kernel"
SOURCE_FILE = "kernel.py"
INTERPRETER_ARCH = "interpreter"  # the pseudo-arch of kernels run in Triton's interpreter

# Kernel arguments in order (see the template's prefill_kernel); strides are in elements.
STRIDES = (
    "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
)  # fmt: skip
ARG_NAMES = ("Q", "K", "V", "O", "cu_seqlens_q", "cu_seqlens_k", "qk_scale", *STRIDES, "n_tiles")
# Arguments compiled as divisible by 16 (pointers: 16-byte aligned; strides: multiples of 16
# elements); `validate.check_alignment` enforces exactly this before every launch.
ALIGNED_ARGS = ("Q", "K", "V", "O", *STRIDES)
PER_HEAD = ("local_blocks", "vert_stride", "sliding_window", "sink_tokens")  # besides vert_offset
LOG2E = 1.4426950408889634
FEATURES = frozenset({"sink_tokens", "logit_softcap", "learned_sinks"})  # what the template implements
HEAD_DIMS = tuple(range(32, 257, 16))  # padded to a power of two in the tile width


def arg_names(layer: LayerSpec) -> tuple[str, ...]:
    """prefill_kernel's arguments for `layer`: a learned-sinks layer adds `Sinks` after O."""
    if not layer.learned_sinks:
        return ARG_NAMES
    return (*ARG_NAMES[:4], "Sinks", *ARG_NAMES[4:])


def pick_config(dtype: str, head_dim: int, arch: str) -> dict[str, int]:
    """Tile sizes and launch shape, chosen by rule (never autotuned, so the key pins them)."""
    if arch == INTERPRETER_ARCH:  # small tiles keep the interpreter quick
        return {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1}
    cc = parse_arch(arch)
    if head_dim > 128:  # 256-wide tiles: a [64, 256] fp32 accumulator, K/V tiles of 32 keys, 2 stages
        return {"block_m": 64, "block_n": 32, "num_warps": 8 if cc >= 80 else 4, "num_stages": 2}
    if cc >= 90 or cc == 80:
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3 if cc >= 90 else 2}
    return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}  # sm_86/89: ~100 KB smem


NARROW_WINDOW = 128  # windows up to this many keys get narrow key tiles and packed GQA heads
MIN_TILE_ROWS = {"gpu": 16, INTERPRETER_ARCH: 4}  # positions per packed tile, at least


def narrow_config(layer: LayerSpec, config: dict[str, int], arch: str) -> dict[str, int]:
    """`config` for a narrow-window layer: every head the same plain window of at most
    NARROW_WINDOW keys (sink tokens allowed). A query tile of BLOCK_M positions there needs keys
    [m0 - w + 1, m0 + BLOCK_M): mostly masked where BLOCK_M and BLOCK_N are wide next to w. So

      pack     the tile holds `pack` query heads of one KV group x BLOCK_M // pack positions (the
               largest power of two dividing the group size that leaves MIN_TILE_ROWS positions):
               the heads share each K/V tile and the near range spans BLOCK_M // pack positions;
      block_n  32 keys per step on a GPU (the interpreter's 16 already is narrow);
      block_m  64 on a GPU when nothing packs (G = 1), with 4 warps.

    Any other layer, and head dims above 128 on a GPU (already 64 x 32 tiles), get `config`
    itself: their source, and so their key, stay as they were."""
    head = layer.heads[0]
    if any(h != head for h in layer.heads) or head.kind not in ("window", "window+sink"):
        return config
    if head.sliding_window > NARROW_WINDOW:
        return config
    gpu = arch != INTERPRETER_ARCH
    if gpu and layer.head_dim > 128:
        return config
    out = dict(config)
    if gpu:
        out["block_n"] = min(out["block_n"], 32)
    pack = 1
    min_rows = MIN_TILE_ROWS["gpu" if gpu else INTERPRETER_ARCH]
    while layer.group_size % (2 * pack) == 0 and out["block_m"] // (2 * pack) >= min_rows:
        pack *= 2
    if pack > 1:
        out["pack"] = pack
    elif gpu:
        out.update(block_m=64, num_warps=4)
    return out


def packs_query_heads(layer: LayerSpec, arch: str) -> bool:
    """Whether `narrow_config` packs a KV group's query heads into one tile for `layer` on `arch`
    (a GPU's 128-row tiles). On sm_90 such a layer runs faster in the tl kernel than in Gluon's
    128 x 128 tiles, which are mostly masked there (gpt-oss's window-128 layer at 8K: 0.123 against
    0.218 ms on the H200; docs/performance.md), so `base.default_variant` takes tl for it."""
    return narrow_config(layer, {"block_m": 128, "block_n": 64, "num_warps": 8}, arch).get("pack", 1) > 1


def signature(dtype: str, learned_sinks: bool = False) -> dict[str, str]:
    """Triton's argument types of prefill_kernel for `dtype` ('fp16' / 'bf16' / 'fp32'); with
    `learned_sinks` the `Sinks` pointer (float32 [H]) follows O."""
    from ..dtypes import resolve

    ptr = resolve(dtype).triton_pointer
    types = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr}
    if learned_sinks:
        types["Sinks"] = "*fp32"
    types.update({"cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32"})
    types["qk_scale"] = "fp32"
    types.update({s: "i32" for s in STRIDES})
    types["n_tiles"] = "i32"
    return types


def _ranges(heads: list[int]) -> list[list[int]]:
    """[0, 1, 2, 5] -> [[0, 3], [5, 6]]: half-open runs of consecutive head numbers."""
    out: list[list[int]] = []
    for h in heads:
        if out and out[-1][1] == h:
            out[-1][1] = h + 1
        else:
            out.append([h, h + 1])
    return out


def _affine_offsets(heads: list[int], offsets: list[int], stride: int) -> tuple[int, int] | None:
    """(a, c) with offset(h) == (a*h + c) % stride for every head, if such a rule exists."""
    if stride > 64:
        return None
    for a in range(stride):
        for c in range(stride):
            if all((a * h + c) % stride == o for h, o in zip(heads, offsets)):
                return a, c
    return None


def _per_head(heads: list[int], values: list[int]) -> dict[str, Any]:
    """A per-head number of one path: `uniform` with its `value`, or a `default` (the most common
    value) plus `cases`: [value, head ranges] for the other values."""
    by_value: dict[int, list[int]] = {}
    for h, v in zip(heads, values):
        by_value.setdefault(v, []).append(h)
    default = max(by_value, key=lambda v: len(by_value[v]))
    cases = [[v, _ranges(hs)] for v, hs in by_value.items() if v != default]
    return {"uniform": not cases, "value": default, "default": default, "cases": cases}


def _path(pid: int, layer: LayerSpec, heads: list[int], block_n: int) -> dict[str, Any]:
    spec = layer.heads[heads[0]]
    specs = [layer.heads[h] for h in heads]
    path: dict[str, Any] = {
        "id": pid,
        "kind": spec.kind,
        "dense": spec.dense,
        "has_local": bool(spec.local_blocks) and not spec.dense,
        "has_vert": bool(spec.vert_stride) and not spec.dense,
        "has_window": bool(spec.sliding_window) and not spec.dense,
        "has_sink": bool(spec.sink_tokens) and not spec.dense,
        "block_size": spec.block_size,
        "vert_block_n": min(spec.block_size, block_n),  # keys per step over a vertical block
        "ranges": _ranges(heads),
    }
    for name in PER_HEAD:
        path[name] = _per_head(heads, [0 if s.dense else getattr(s, name) for s in specs])
    offsets = [s.vert_offset for s in specs]
    stride = path["vert_stride"]
    path["vert_offset"] = _per_head(heads, offsets)
    affine = None  # offsets that follow (a*h + c) % stride take one multiply-add, not a select chain
    if path["has_vert"] and stride["uniform"] and not path["vert_offset"]["uniform"]:
        affine = _affine_offsets(heads, offsets, stride["value"])
    path["vert_offset_affine"] = [affine[0], affine[1]] if affine else []
    return path


def template_constants(layer: LayerSpec, config: dict[str, int]) -> dict[str, Any]:
    """Everything the template receives: shapes, tile sizes and one dict per path."""
    groups: dict[tuple, list[int]] = {}
    for h, head in enumerate(layer.heads):
        groups.setdefault(path_key(head), []).append(h)
    paths = [_path(pid, layer, heads, config["block_n"]) for pid, heads in enumerate(groups.values())]
    head_dim_pow2 = 1 << (layer.head_dim - 1).bit_length()
    return {
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "head_dim_pow2": head_dim_pow2,
        "group_size": layer.group_size,
        "block_m": config["block_m"],
        "block_n": config["block_n"],
        "pack": config.get("pack", 1),  # query heads per tile (narrow_config); 1: one head per tile
        "paths": paths,
        "softcap": bool(layer.logit_softcap),
        # the cap as an exact ratio of ints (templates take typed constants only, no floats)
        "softcap_ratio": list(float(layer.logit_softcap).as_integer_ratio()),
        "learned_sinks": layer.learned_sinks,
    }


def render_source(layer: LayerSpec, config: dict[str, int]) -> str:
    return render(TEMPLATE, **template_constants(layer, config))


def kernel_name(layer: LayerSpec, dtype: str, variant: str = "tl") -> str:
    """Readable half of the key, e.g. prefill_bf16_hd128_h32kv8_bs64_l16_v8 (the default "tl"
    variant is not spelled; another one is: prefill_gluon_bf16_...)."""
    kind = "prefill" if variant == "tl" else f"prefill_{variant}"
    name = f"{kind}_{dtype}_hd{layer.head_dim}_h{layer.num_heads}kv{layer.num_kv_heads}_{pattern_name(layer)}"
    return name + feature_suffix(layer)


def feature_suffix(layer: LayerSpec) -> str:
    """The layer-wide features in a kernel name: _cap50 (soft-cap 50; 30.5 -> cap30p5), _lsink
    (learned sinks); empty for a layer without them. Sink tokens are in the pattern (_s4)."""
    out = ""
    if layer.logit_softcap:
        out += "_cap" + f"{layer.logit_softcap:g}".replace(".", "p").replace("-", "m").replace("+", "")
    if layer.learned_sinks:
        out += "_lsink"
    return out
