"""The prefill cases of `sparsegen bench` and the arithmetic of its prefill rows.

The cases are the layers that dense, sliding-window and sparse models run (batch 1, bf16):
  dense       Phi-3-Small's dense layer: 32 q / 8 KV heads, hd 128, plain causal
  window      32 q / 8 KV heads, hd 128, window 4096 (Mistral, Qwen; the sliding-window preset)
  phi3small   Phi-3-Small's sparse layer: block 64, 16 local blocks, vertical stride 8
  gpt-oss     gpt-oss's window layer: 64 q / 8 KV heads, hd 64, window 128, learned sinks
  gemma2      Gemma-2's local layer: 16 q / 8 KV heads, hd 256, window 4096, soft-cap 50,
              scale 256 ** -0.5
at 8K and 32K; dense causal also at 128K, which runs only with `--long` (it is slow).

A row's ratios compare times from one process: `x_best_peer` = the fastest peer's time over
sparsegen's (above 1: sparsegen is faster). A peer is a kernel that computes the same attention
(same pattern, soft-cap and sinks); a peer that could not run holds a string "n/a (why)" in
place of its time and takes no part in the ratio. `of_ceiling` is the useful FLOPs (4 * D *
visible pairs) at the bf16 matmul rate measured in the same run, over the kernel's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import InputError
from ...presets import get_pattern
from ...spec import HeadSpec, LayerSpec

PEERS = ("sdpa", "flex", "flex_flash", "fa4")  # the columns of a prefill row's "peers"
LONG_SEQ_LEN = 131072


def _gpt_oss() -> LayerSpec:
    return LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True)


def _gemma2() -> LayerSpec:
    head = HeadSpec(block_size=64, sliding_window=4096)
    return LayerSpec(16, 8, 256, (head,) * 16, logit_softcap=50.0, scale=256**-0.5)


LAYERS = {
    "dense": lambda: get_pattern("phi3small").layers[1],
    "window": lambda: get_pattern("sliding-window").layers[0],
    "phi3small": lambda: get_pattern("phi3small").layers[0],
    "gpt-oss": _gpt_oss,
    "gemma2": _gemma2,
}


@dataclass(frozen=True)
class PrefillCase:
    name: str  # a key of LAYERS
    seq_len: int
    long: bool = False  # runs only when asked for (`--long`)

    def layer(self) -> LayerSpec:
        return LAYERS[self.name]()


PREFILL_CASES = (
    PrefillCase("dense", 8192),
    PrefillCase("dense", 32768),
    PrefillCase("dense", LONG_SEQ_LEN, long=True),
    PrefillCase("window", 8192),
    PrefillCase("window", 32768),
    PrefillCase("phi3small", 8192),
    PrefillCase("phi3small", 32768),
    PrefillCase("gpt-oss", 8192),
    PrefillCase("gpt-oss", 32768),
    PrefillCase("gemma2", 8192),
    PrefillCase("gemma2", 32768),
)


def select_cases(*, long: bool, max_seq_len: int, names: tuple[str, ...] = ()) -> list[PrefillCase]:
    """The cases to run: the long ones only with `long`, none above `max_seq_len`, and only the
    named layers when `names` is given (each must be a key of LAYERS)."""
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        raise InputError(f"unknown prefill case(s) {unknown}; the cases are {list(LAYERS)}")
    return [
        c
        for c in PREFILL_CASES
        if (long or not c.long) and c.seq_len <= max_seq_len and (not names or c.name in names)
    ]


def is_time(value: object) -> bool:
    """A measured time (a positive finite float); a peer that did not run holds a string."""
    return isinstance(value, float) and math.isfinite(value) and value > 0


def summarize(row: dict) -> dict:
    """Add the ratios to a row holding "sparsegen_ms", "floor_ms" and "peers" ({peer: ms or
    "n/a (why)"}): "of_ceiling" ({"sparsegen": f, peer: f or None}), "best_peer" (the fastest
    peer that ran, or None) and "x_best_peer" (its time over sparsegen's, NaN with no peer)."""
    sg, floor, peers = row["sparsegen_ms"], row["floor_ms"], row["peers"]
    if not is_time(sg) or not is_time(floor):
        raise InputError(f"sparsegen_ms and floor_ms must be positive times, got {sg!r} and {floor!r}")
    if set(peers) != set(PEERS):
        raise InputError(f"peers must have exactly the columns {list(PEERS)}, got {sorted(peers)}")
    for name, value in peers.items():
        if not is_time(value) and not (isinstance(value, str) and value.startswith("n/a (")):
            raise InputError(f"peer {name} must be a positive time or an 'n/a (why)' string, got {value!r}")
    ran = {name: ms for name, ms in peers.items() if is_time(ms)}
    row["of_ceiling"] = {
        "sparsegen": floor / sg,
        **{n: (floor / ran[n] if n in ran else None) for n in PEERS},
    }
    best = min(ran, key=ran.get) if ran else None
    row["best_peer"] = best
    row["x_best_peer"] = ran[best] / sg if best else float("nan")
    return row
