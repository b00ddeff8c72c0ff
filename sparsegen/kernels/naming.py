"""Readable kernel names, one vocabulary for both families.

A name spells every specialisation: dtype, head_dim, shapes, and the pattern of each group of
heads that shares a kind and block size (`path_key`). Numbers that vary across such a group are
spelled as their range (`l2to16`); a layer with several groups gives each its head count:
`24xbs64_l16_v8__8xdense`; past MAX_PATTERN_CHARS the name keeps the first groups and says how
many more (`..._and3more`). Names only help people: the key's digest decides identity.
"""

from __future__ import annotations

from ..spec import HeadSpec, LayerSpec

FIELDS = (("l", "local_blocks"), ("v", "vert_stride"), ("w", "sliding_window"), ("s", "sink_tokens"))
MAX_PATTERN_CHARS = 120  # the cache allows 200 characters per name; the rest is dtype and shapes


def path_key(head: HeadSpec) -> tuple:
    """Heads with the same kind and block size share one compiled code path."""
    if head.dense:
        return ("dense",)
    return (head.kind, head.block_size)


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}to{hi}"


def pattern_name(layer: LayerSpec) -> str:
    """bs64_l16_v8 for a uniform layer; 24xbs64_l16_v8__8xdense for one with two head groups."""
    groups: dict[tuple, list[HeadSpec]] = {}
    for head in layer.heads:
        groups.setdefault(path_key(head), []).append(head)
    parts = []
    for key, heads in groups.items():
        if key == ("dense",):
            token = "dense"
        else:
            token = f"bs{key[1]}"
            for short, field in FIELDS:
                values = [getattr(h, field) for h in heads]
                if any(values):
                    token += f"_{short}{_span(values)}"
        parts.append(token if len(groups) == 1 else f"{len(heads)}x{token}")
    name = "__".join(parts)
    for keep in range(len(parts) - 1, 0, -1):  # too long: the first groups, then how many more
        if len(name) <= MAX_PATTERN_CHARS:
            break
        name = "__".join(parts[:keep]) + f"__and{len(parts) - keep}more"
    return name
