"""`sparsegen env`: what a bug report needs: versions, the GPU, the cache and the environment.

Reads, never builds: no kernel is compiled and the cache directory is not created. With
--json, one object:
    {"sparsegen", "python", "platform", "torch_cuda": CUDA version of torch's build or null,
     "packages": {dist: version or null}, "extras": {extra: [dist, ...]},
     "triton_tested": [version, ...], "triton_warning": a sentence, or null for a tested Triton,
     "nvrtc", "cuda_include", "gpus": [{"index", "name", "arch", "memory_gib"}],
     "driver": {"version", "cuda"}, "cache": {"dir", "exists", "verdict", "entries"},
     "variables": [{"name", "value", "default", "meaning"}], "other_variables": {name: value}}
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

import click

from .. import __version__

# The distributions of the core requirements and of each extra in pyproject.toml (a test holds
# the two equal), plus cuda-pathfinder, which cuda-core brings and which finds NVRTC.
EXTRAS = {
    "core": ("torch", "triton", "jinja2", "click", "filelock", "safetensors", "tqdm", "numpy"),
    "cu12": ("cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc-cu12"),
    "cu13": ("cuda-core", "cuda-bindings", "nvidia-cuda-nvrtc"),
    "bench": ("flash-attn-4", "nvidia-cutlass-dsl"),
    "fuzz": ("hypothesis",),
    "hf": ("transformers",),
    "model": ("tiktoken", "tokenizers"),
    "plot": ("matplotlib",),
    "serve": ("fastapi", "uvicorn", "prometheus-client"),
    "structured": ("llguidance",),
    "test": (
        "pytest",
        "pytest-randomly",
        "pytest-xdist",
        "build",
        "hatchling",
        "ruff",
        "openai",
        "httpx",
        "transformers",
        "jsonschema",
        "lm-eval",
    ),
}
PACKAGES = tuple(dict.fromkeys([d for dists in EXTRAS.values() for d in dists] + ["cuda-pathfinder"]))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def driver_release(text: str) -> str | None:
    """The release in /proc/driver/nvidia/version's first line, e.g. '570.86.15':
    "NVRM version: NVIDIA UNIX [Open] Kernel Module [for x86_64]  570.86.15  Release Build ..."."""
    found = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)(?:\s|$)", text)
    return found.group(1) if found else None


def _driver() -> dict:
    """The kernel driver's release (Linux: /proc/driver/nvidia/version) and the CUDA version it
    supports (cuDriverGetVersion through cuda-bindings, when both are there)."""
    out: dict = {"version": None, "cuda": None}
    try:
        out["version"] = driver_release(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        pass
    try:
        from cuda.bindings import driver

        err, = driver.cuInit(0)[:1]  # fmt: skip
        if int(err) == 0:
            err, version = driver.cuDriverGetVersion()
            if int(err) == 0:
                out["cuda"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001 - no cuda-bindings or no driver: reported as null
        pass
    return out


def _gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": props.name, "arch": f"sm_{props.major}{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1)})  # fmt: skip
    return out


def _cache() -> dict:
    from .. import env
    from ..errors import SparsegenError

    root = env.cache_dir()
    info: dict = {"dir": str(root), "exists": root.exists(), "verdict": None, "entries": None}
    if not root.exists():
        info["verdict"] = "absent: created (private) by the first compile"
        return info
    from ..jit import cache

    try:
        cache.cache_dir()  # the safety checks; it exists, so nothing is created
        info["entries"] = len(cache.list_entries())
        info["verdict"] = "ok"
    except SparsegenError as exc:
        info["verdict"] = f"refused: {str(exc).splitlines()[0]}"
    return info


def _cuda_include() -> str | None:
    try:
        from ..jit.nvrtc_build import cuda_include_dir

        return cuda_include_dir()
    except Exception:  # noqa: BLE001 - reported as "not found"
        return None


def _shown(flag) -> str | None:
    """A variable's value for the report; a secret's only as "(set)", so a pasted report leaks no key."""
    raw = os.environ.get(flag.name)
    return "(set)" if flag.kind == "secret" and raw else raw


def _variables() -> list[dict]:
    from .. import env

    return [
        {"name": f.name, "value": _shown(f), "default": f.default, "meaning": f.meaning}
        for f in env.FLAGS.values()
    ]


def _torch_cuda() -> str | None:
    """The CUDA version torch was built with (None for a CPU-only build)."""
    import torch

    return torch.version.cuda


def collect() -> dict:
    from .. import env
    from ..jit import triton_support
    from ..jit.cache import nvrtc_version

    packages = {name: _version(name) for name in PACKAGES}
    return {
        "sparsegen": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_cuda": _torch_cuda(),
        "packages": packages,
        "extras": {extra: list(dists) for extra, dists in EXTRAS.items()},
        "triton_tested": list(triton_support.TESTED),
        "triton_warning": triton_support.warning(packages["triton"]),
        "nvrtc": nvrtc_version(),
        "cuda_include": _cuda_include(),
        "gpus": _gpus(),
        "driver": _driver(),
        "cache": _cache(),
        "variables": _variables(),
        "other_variables": {name: os.environ.get(name) for name in env.OTHER_VARS},
    }


def _text(report: dict) -> str:
    lines = [f"sparsegen {report['sparsegen']}  python {report['python']}  {report['platform']}", ""]
    cuda = report["torch_cuda"]
    lines.append(
        f"torch {report['packages']['torch'] or '-'}: "
        + (f"built for CUDA {cuda}" if cuda else "CPU-only build")
    )
    if report["triton_warning"]:
        lines.append(f"warning: {report['triton_warning']}")
    else:
        tested = ", ".join(report["triton_tested"])
        lines.append(f"triton {report['packages']['triton']}: a tested release ({tested})")
    lines += ["", "packages (by the extra that brings them; - = not installed)"]
    listed = set()
    for extra, dists in report["extras"].items():
        lines.append(f"  [{extra}]" if extra != "core" else "  core")
        for name in dists:
            lines.append(f"    {name:<22} {report['packages'][name] or '-'}")
            listed.add(name)
    for name in (n for n in report["packages"] if n not in listed):
        lines.append(f"  {name:<24} {report['packages'][name] or '-'}")
    lines.append(f"  {'NVRTC':<24} {report['nvrtc']}")
    lines.append(f"  {'CUDA headers for NVRTC':<24} {report['cuda_include'] or 'not found'}")
    lines += ["", "GPU"]
    drv = report["driver"]
    lines.append(f"  driver {drv['version'] or '-'} (CUDA {drv['cuda'] or '-'})")
    if not report["gpus"]:
        lines.append("  none seen by torch: kernels compile ahead of time (sm_90 by default)")
    for g in report["gpus"]:
        lines.append(f"  cuda:{g['index']} {g['name']} {g['arch']} {g['memory_gib']} GiB")
    c = report["cache"]
    lines += ["", "kernel cache", f"  {c['dir']}: {c['verdict']}" + (
        f", {c['entries']} entries" if c["entries"] is not None else "")]  # fmt: skip
    lines += ["", "environment (set / default: meaning)"]
    for v in report["variables"]:
        shown = repr(v["value"]) if v["value"] is not None else f"unset (default {v['default']})"
        lines.append(f"  {v['name']} = {shown}")
        lines.append(f"      {v['meaning']}")
    others = {k: v for k, v in report["other_variables"].items() if v is not None}
    lines.append(
        "  other tools' variables: " + (", ".join(f"{k}={v!r}" for k, v in others.items()) or "none set")
    )
    return "\n".join(lines)


@click.command(name="env")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(as_json: bool) -> None:
    """Report versions, the GPU, the cache directory and every SPARSEGEN_* variable."""
    report = collect()
    click.echo(json.dumps(report, indent=1) if as_json else _text(report))
