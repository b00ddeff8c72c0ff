"""`sparsegen compile`: build (or fetch from the cache) every distinct kernel a pattern needs.

A model's layers often share one spec (Phi-3-Small: one sparse and one dense layer kind), so
each distinct LayerSpec is built once per kernel kind. With --model-kernels the kernels the
model (Phi-3-Small, or a decoder family's config.json) launches besides attention are built too
(GEMV, few-row GEMM, rotary + KV write, GeGeLU, add + LayerNorm / RMSNorm: `models.kernel_plan`), each record with its own kind. Progress
goes to stderr, one line per kernel and a summary; stdout gets a table, or with --json the list DESIGN §3 promises:
    [{"kind", "name", "key", "arch", "status", "seconds", "path"}, ...]
With --kv-cache-dtype fp8 (fp8_e4m3, fp8_e5m2) the decode kernels are the ones that read an fp8
cache (their names say so: decode_bf16_kvfp8e4m3_...); the prefill kernels stay the ones over
q's dtype, since the engine dequantises the cached prefix in its gather.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import click

from .. import dtypes, env
from ..errors import CheckpointError
from ..jit import build_workers
from ..kernels import base
from ..kernels.decode import PAGE_SIZES
from ..log import get_logger
from . import progress
from .options import check_arch, kv_cache_dtype_option, load_pattern
from .table import format_table

DTYPES = {name: dtypes.resolve(name).torch for name in dtypes.CLI_NAMES}
NO_GPU_ARCH = "sm_90"
log = get_logger(__name__)


def default_arch() -> str:
    return env.current_arch() or NO_GPU_ARCH


MODEL_PRESETS = ("phi3small", "phi3small-128k")  # patterns whose model is the 7b Phi-3-Small
TRITON_KINDS = ("prefill", "gemv", "rotary_kv_write", "gegelu", "add_norm")  # built by Triton


def model_config(pattern: str):
    """The model config whose kernels --model-kernels builds: the 7b Phi-3-Small shapes for the
    phi3small presets, else the pattern's HF config.json of any family (`models.families`); a
    usage error for anything else."""
    from ..models.config import Phi3SmallConfig
    from ..models.families import FAMILY_TYPES, config_from_file

    if pattern in MODEL_PRESETS:
        return Phi3SmallConfig()
    if Path(pattern).is_file():
        try:
            return config_from_file(pattern)
        except (CheckpointError, ValueError) as exc:
            raise click.BadParameter(f"{pattern} is not a config.json of a model sparsegen runs: {exc}",
                                     param_hint="'--model-kernels'") from None  # fmt: skip
    raise click.BadParameter(
        f"--model-kernels builds a model's kernels: --pattern must be one of {MODEL_PRESETS} or a "
        f"config.json of one of {', '.join(FAMILY_TYPES)}, got {pattern!r}",
        param_hint="'--model-kernels'",
    )


def build_all(
    model, kinds, dtype, arch: str, page_size: int, *, as_json: bool = False, model_requests=(), kv_dtype=None
) -> list[dict]:
    """Build each (kind, distinct layer) kernel, then each of `model_requests` (lifecycle
    requests of the model's own kernels); returns DESIGN §3 records in job order.

    Builds run side by side, a thread per kernel (up to the CPU count). NVRTC releases the GIL;
    Triton's front end does not (in threads, the two phi3small Gluon kernels took their summed
    time, 5.4 s, on the H200 host), so Triton builds go to worker processes
    (`jit.build_workers`), started first so that their start-up overlaps the rest. Parallel
    Triton builds were checked to give the same PTX as one-at-a-time builds (3 x 6 kernels).

    Progress: one line per kernel as it finishes, its status, arch and seconds (through the
    "sparsegen" logger, whose handler writes whole lines under a lock, so parallel builds never
    interleave); the cache's own "compiling ..." / "compiled ..." lines are left out, since that
    line says the same. On a terminal, one bar over the kernels also names the ones building.
    """
    jobs = [(kind, layer) for kind in kinds for layer, _ in model.distinct_layers()]
    jobs += [(request.kind, request) for request in model_requests]
    total = len(jobs)
    bar = progress.bar(total, "compile", unit="kernel", as_json=as_json)
    building: dict[int, str] = {}
    lock = threading.Lock()

    def building_now() -> str:
        return ", ".join(building[n] for n in sorted(building))

    def build(n: int, kind: str, what) -> dict:
        from .. import ops

        model_kernel = isinstance(what, base.KernelRequest)
        with lock:
            building[n] = (
                kind if model_kernel else f"{kind} {'/'.join(what.kinds)}"
            )  # e.g. "decode local+vert"
            bar.note(building_now())
        start = time.perf_counter()
        extra = {"page_size": page_size, "kv_dtype": kv_dtype} if kind == "decode" else {}
        try:
            if model_kernel:
                found = base.lookup(what)
            else:
                found = ops.lookup_kernel(what, kind, dtype=dtype, arch=arch, **extra)
        finally:
            with lock:
                building.pop(n)
                now = building_now()
        seconds = time.perf_counter() - start
        kernel = found.kernel
        status = "cached" if found.status in ("cached", "memory") else found.status
        log.info(f"[{n}/{total}] {status} {kernel.name} ({arch}) in {seconds:.2f} s")
        bar.update(1, postfix=now)
        return {
            "kind": kind,
            "name": kernel.name,
            "key": kernel.key,
            "arch": arch,
            "status": status,
            "seconds": round(seconds, 4),
            "path": str(kernel.path),
        }

    triton_jobs = sum(kind in TRITON_KINDS for kind, _ in jobs)
    with progress.quiet_cache_log(), bar:
        return build_workers.map_in_threads(
            lambda job: build(job[0], *job[1]), list(enumerate(jobs, 1)), triton_builds=triton_jobs
        )  # in job order


@click.command(name="compile")
@click.option("--pattern", required=True, help="Preset name, sparsegen JSON spec or HF config.json.")
@click.option(
    "--arch",
    default=None,
    callback=check_arch,
    help="Target, e.g. sm_90 (default: this GPU; sm_90 without one).",
)
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="bf16", show_default=True)
@click.option("--kind", type=click.Choice(["prefill", "decode", "all"]), default="all", show_default=True)
@click.option("--page-size", type=int, default=16, show_default=True, help="Decode kernels' page size.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per kernel.")
@click.option(
    "--model-kernels",
    is_flag=True,
    help="Also build the model's own kernels (GEMV, few-row GEMM, rotary, GeGeLU, norm): Phi-3-Small's, "
    "or those of the family a config.json names.",
)
@kv_cache_dtype_option
def command(pattern, arch, dtype, kind, page_size, as_json, model_kernels, kv_cache_dtype):
    """Compile (or fetch from the cache) every distinct kernel of a pattern."""
    model = load_pattern(pattern)
    arch = default_arch() if arch is None else arch  # '' is refused by check_arch, not defaulted
    kinds = ["prefill", "decode"] if kind == "all" else [kind]
    if ("decode" in kinds or model_kernels) and page_size not in PAGE_SIZES:  # before any kernel is built
        raise click.BadParameter(
            f"decode page size must be in {PAGE_SIZES.start}..{PAGE_SIZES.stop - 1}, got {page_size}",
            param_hint="'--page-size'",
        )
    requests = []
    kv_dtype = None if kv_cache_dtype == "auto" else dtypes.KV_CACHE_DTYPE_NAMES[kv_cache_dtype]
    if model_kernels:
        from ..models.kernel_plan import model_kernel_requests

        requests = model_kernel_requests(model_config(pattern), DTYPES[dtype], arch, page_size, kv_dtype)
    start = time.perf_counter()
    records = build_all(
        model,
        kinds,
        DTYPES[dtype],
        arch,
        page_size,
        as_json=as_json,
        model_requests=requests,
        kv_dtype=kv_dtype,
    )
    total = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps(records, indent=1))
    else:
        rows = [[r["kind"], r["name"], r["status"], r["seconds"], r["path"]] for r in records]
        click.echo(format_table(["kind", "name", "status", "seconds", "path"], rows))
    built = sum(r["status"] == "compiled" for r in records)
    log.info(
        f"{len(records)} kernels for {model.name} ({arch}, {dtype}, KV cache {kv_cache_dtype}): {built} compiled, "
        f"{len(records) - built} cached, {total:.2f} s"
    )
