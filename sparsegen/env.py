"""The environment sparsegen reads, in one place: flags, the cache directory, the GPU's arch.

    from sparsegen import env
    env.flag("SPARSEGEN_DISABLE_JIT")   # True / False; a value it cannot read -> EnvError
    env.cache_dir()                      # where kernels are cached (resolution only)
    env.current_arch()                   # "sm_90" on an H100/H200, None without a CUDA GPU
    env.parse_arch("sm_90")              # 90; anything else -> ArchError

Every `SPARSEGEN_*` variable the code reads is listed in `FLAGS` with its meaning and default
(`sparsegen env` prints them). A boolean flag reads 1/true/yes/on as on and 0/false/no/off
(or empty, or unset) as off, case-insensitively; any other value is an `EnvError` naming the
variable, never a silent guess.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ArchError, EnvError

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off", ""})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Flag:
    """One environment variable: its name, what kind of value it holds, default and meaning."""

    name: str
    kind: str  # "bool" | "path" | "level" | "secret" (never shown by `sparsegen env`)
    default: str
    meaning: str


FLAGS: dict[str, Flag] = {
    f.name: f
    for f in (
        Flag("SPARSEGEN_CACHE_DIR", "path", "$XDG_CACHE_HOME/sparsegen or ~/.cache/sparsegen",
             "directory of the kernel cache"),
        Flag("SPARSEGEN_DISABLE_JIT", "bool", "0",
             "a kernel missing from the cache raises JitDisabledError instead of compiling"),
        Flag("SPARSEGEN_DEBUG", "bool", "0",
             "check=True by default: validate cu_seqlens / seq_lens / page ids on the host"),
        Flag("SPARSEGEN_CUDA_INCLUDE", "path", "(searched)",
             "a CUDA include/ directory with cuda_fp16.h and cuda_bf16.h, for NVRTC"),
        Flag("SPARSEGEN_POISON_OUTPUT", "bool", "0",
             "fill kernel outputs with NaN before launch, so unwritten rows show up in tests"),
        Flag("SPARSEGEN_LOG_LEVEL", "level", "INFO",
             f"level of the 'sparsegen' logger ({', '.join(LOG_LEVELS)})"),
        Flag("SPARSEGEN_QUIET", "bool", "0", "only errors on stderr: no 'compiling ...' lines, no progress bars"),
        Flag("SPARSEGEN_PREFILL_TL", "bool", "0",
             "prefill on sm_90 uses the tl Triton kernel instead of the Gluon (FA3-style) one"),
        Flag("SPARSEGEN_API_KEY", "secret", "(none)",
             "the key `sparsegen serve` asks for on /v1/* (Authorization: Bearer KEY); --api-key wins"),
        Flag("SPARSEGEN_NO_PDL", "bool", "0",
             "the model's fused add + LayerNorm kernel launches without programmatic dependent launch (sm_90)"),
    )
}  # fmt: skip

# Variables of other tools that change what sparsegen does (reported by `sparsegen env`).
OTHER_VARS = ("TRITON_INTERPRET", "XDG_CACHE_HOME", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES")


def _registered(name: str, kind: str) -> Flag:
    spec = FLAGS.get(name)
    if spec is None or spec.kind != kind:
        raise KeyError(f"{name} is not a registered {kind} variable in sparsegen.env.FLAGS")
    return spec


def parse_bool(name: str, raw: str | None) -> bool:
    """1/true/yes/on -> True; 0/false/no/off/''/unset -> False; else EnvError naming `name`."""
    if raw is None:
        return False
    word = raw.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean; use 1/true/yes/on or 0/false/no/off")


def flag(name: str) -> bool:
    """The boolean flag `name` (one of FLAGS) as read from the environment now."""
    _registered(name, "bool")
    return parse_bool(name, os.environ.get(name))


def path(name: str) -> Path | None:
    """The path variable `name` (one of FLAGS), `~` expanded; None when unset or empty."""
    _registered(name, "path")
    raw = os.environ.get(name)
    return Path(raw).expanduser() if raw else None


def secret(name: str) -> str | None:
    """The secret variable `name` (one of FLAGS); None when unset or empty."""
    _registered(name, "secret")
    return os.environ.get(name) or None


def log_level() -> str:
    """SPARSEGEN_LOG_LEVEL, upper-cased and checked; INFO when unset."""
    raw = os.environ.get("SPARSEGEN_LOG_LEVEL")
    if not raw:
        return FLAGS["SPARSEGEN_LOG_LEVEL"].default
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise EnvError(f"SPARSEGEN_LOG_LEVEL={raw!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def interpreting() -> bool:
    """TRITON_INTERPRET as Triton itself reads it (1/true/yes/on/y, case-insensitive): whether
    Triton's interpreter is requested. `ops.interpreter_usable()` also checks it took effect."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def cache_dir() -> Path:
    """Where the kernel cache lives: $SPARSEGEN_CACHE_DIR, else $XDG_CACHE_HOME/sparsegen (an
    absolute XDG_CACHE_HOME only, as the XDG spec says), else ~/.cache/sparsegen. Resolution
    only: `jit.cache.cache_dir()` creates it and refuses unsafe directories."""
    explicit = path("SPARSEGEN_CACHE_DIR")
    if explicit is not None:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "sparsegen"
    return Path.home() / ".cache" / "sparsegen"


# Compute capabilities sparsegen's kernels target (sm_80 or newer, as NVRTC and Triton know them).
KNOWN_ARCHES = frozenset({80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121})


def parse_arch(arch: object) -> int:
    """'sm_90' -> 90 ('sm_90a', the arch-specific variant, -> 90 too). Anything else -- an int,
    '', 'sm_90aa', '90', an arch sparsegen does not know or one below sm_80 -> ArchError."""
    if not isinstance(arch, str):
        raise ArchError(f"arch must be a string like 'sm_90', got {type(arch).__name__} {arch!r}")
    body = arch[3:] if arch.startswith("sm_") else None
    if body and body.endswith("a"):
        body = body[:-1]
    if not body or not body.isascii() or not body.isdigit() or body[0] == "0":
        raise ArchError(f"arch must look like 'sm_90' or 'sm_90a', got {arch!r}")
    cc = int(body)
    if cc not in KNOWN_ARCHES:
        known = ", ".join(f"sm_{c}" for c in sorted(KNOWN_ARCHES))
        raise ArchError(f"arch {arch!r} is not one sparsegen targets (sm_80 or newer: {known})")
    return cc


def check_arch(arch: object) -> str:
    """`arch` itself once `parse_arch` accepts it (for code that keeps the string)."""
    parse_arch(arch)
    return arch  # type: ignore[return-value]


def current_arch(device=None) -> str | None:
    """The arch of `device` (default: the current CUDA device), e.g. 'sm_90'; None without a
    CUDA GPU. Never raises: callers that need a GPU say why they do."""
    import torch

    if not torch.cuda.is_available():
        return None
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _arch_of(index)


@functools.cache  # a device's arch never changes within a process; this is on every launch's path
def _arch_of(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def gpu_capable(device=None) -> bool:
    """Whether `device` (default: the current CUDA device) is a CUDA GPU of sm_80 or newer,
    the oldest the compiled kernels support."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


PDL_MIN_ARCH = 90  # griddepcontrol (programmatic dependent launch) needs sm_90


def supports_pdl(device=None) -> bool:
    """Whether `device` (default: the current CUDA device) can launch kernels with programmatic
    dependent launch (sm_90+); cached, as it is asked on every decode launch."""
    arch = current_arch(device)
    return arch is not None and parse_arch(arch) >= PDL_MIN_ARCH


def resolve_arch(arch: object = None) -> str:
    """`arch` checked by `parse_arch`, or this GPU's arch when None; without a GPU, None is an
    ImplUnavailableError that says to pass one (kernels then compile ahead of time)."""
    if arch is None:
        here = current_arch()
        if here is None:
            from .errors import ImplUnavailableError

            raise ImplUnavailableError("no CUDA GPU here: pass arch= (e.g. 'sm_90') to compile ahead of time")
        return here
    parse_arch(arch)
    return arch  # type: ignore[return-value]
