"""`sparsegen compile`: build (or fetch from the cache) every distinct kernel a pattern needs.

A model's layers often share one spec (Phi-3-Small: one sparse and one dense layer kind), so
each distinct LayerSpec is built once per kernel kind. Progress goes to stderr; stdout gets a
summary table, or with --json the list DESIGN §3 promises:
    [{"kind", "name", "key", "arch", "status", "seconds", "path"}, ...]
"""

from __future__ import annotations

import json
import sys
import time

import click
import torch

from ..bench.common import format_table
from ..errors import CompileError
from .options import load_pattern

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NO_GPU_ARCH = "sm_90"


def default_arch() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return NO_GPU_ARCH


def _decode_available() -> bool:
    try:
        import sparsegen.kernels.decode  # noqa: F401
    except ImportError:
        return False
    return True


def build_all(model, kinds, dtype, arch: str, page_size: int, progress=None) -> list[dict]:
    """Build each (kind, distinct layer) kernel; returns DESIGN §3 records."""
    from .. import ops

    jobs = [(kind, layer) for kind in kinds for layer, _ in model.distinct_layers()]
    records = []
    for n, (kind, layer) in enumerate(jobs, 1):
        if progress:
            progress(f"[{n}/{len(jobs)}] {kind} kernel for a {layer.kinds} layer ({arch}) ...")
        start = time.perf_counter()
        extra = {"page_size": page_size} if kind == "decode" else {}
        kernel = ops.get_kernel(layer, kind, dtype=dtype, arch=arch, **extra)
        seconds = time.perf_counter() - start
        status = "cached" if kernel.status in ("cached", "memory") else kernel.status
        records.append(
            {
                "kind": kind,
                "name": kernel.name,
                "key": kernel.key,
                "arch": arch,
                "status": status,
                "seconds": round(seconds, 4),
                "path": str(kernel.path),
            }
        )
        if progress:
            progress(f"[{n}/{len(jobs)}] {status} {kernel.name} in {seconds:.2f} s")
    return records


@click.command(name="compile")
@click.option("--pattern", required=True, help="Preset name, sparsegen JSON spec or HF config.json.")
@click.option("--arch", default=None, help="Target, e.g. sm_90 (default: this GPU; sm_90 without one).")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="bf16", show_default=True)
@click.option("--kind", type=click.Choice(["prefill", "decode", "all"]), default="all", show_default=True)
@click.option("--page-size", type=int, default=16, show_default=True, help="Decode kernels' page size.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per kernel.")
def command(pattern, arch, dtype, kind, page_size, as_json):
    """Compile (or fetch from the cache) every distinct kernel of a pattern."""
    model = load_pattern(pattern)
    arch = arch or default_arch()
    kinds = ["prefill", "decode"] if kind == "all" else [kind]
    if "decode" in kinds and not _decode_available():
        if kind == "decode":
            raise CompileError(
                "decode kernels are not available in this build (sparsegen.kernels.decode is missing)"
            )
        click.echo("sparsegen: decode kernels are not available yet; compiling prefill only", err=True)
        kinds = ["prefill"]
    start = time.perf_counter()
    records = build_all(
        model, kinds, DTYPES[dtype], arch, page_size, progress=lambda m: click.echo(m, err=True)
    )
    total = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps(records, indent=1))
    else:
        rows = [[r["kind"], r["name"], r["status"], r["seconds"], r["path"]] for r in records]
        click.echo(format_table(["kind", "name", "status", "seconds", "path"], rows))
    built = sum(r["status"] == "compiled" for r in records)
    click.echo(
        f"{len(records)} kernels for {model.name} ({arch}, {dtype}): {built} compiled, "
        f"{len(records) - built} cached, {total:.2f} s",
        err=True,
    )
    sys.stderr.flush()
