"""`sparsegen fuzz`: hypothesis-driven checks of the generated kernels against the reference.

The specs are fixed first (a pattern's distinct layers, or `--specs N` random layers drawn from
the seed), so each costs one compile per kernel; hypothesis then draws `--examples` shapes for
every spec and kernel. On a GPU the compiled kernels run in bf16 and are checked against the
reference in float32 on the GPU; on a CPU the prefill kernel runs in Triton's interpreter (fp16,
small shapes) against float64, and the CUDA decode kernel is not run. Outputs are NaN-poisoned
before every launch, so a row a kernel forgets to write fails. Each failure prints as a one-line
repro; the run ends with one line per kernel (cases, failures, worst error) and the seed.
"""

from __future__ import annotations

import os
import random
from unittest import mock

import click
import torch

from .. import env
from ..errors import ImplUnavailableError
from ..log import get_logger
from . import progress
from .options import SEED

log = get_logger(__name__)

KERNELS = ("prefill", "decode")


def _run(
    kernel: str, strategy, examples: int, tol: float, exact: bool, seed: int, bar, tally: dict
) -> tuple[int, float, list]:
    """(cases run, worst relative error, failure lines) for one spec's strategy; every case
    advances `bar`, and `tally["failed"]` counts failures over the whole run."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from .. import ops
    from ..testing import rel_err

    launch = ops.prefill if kernel == "prefill" else ops.paged_decode
    impl = "triton" if kernel == "prefill" else "cuda"
    failures: list[str] = []
    stats = {"cases": 0, "worst": 0.0}

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(problem):
        stats["cases"] += 1
        try:
            kwargs = problem.kwargs() if hasattr(problem, "kwargs") else {}  # sinks= of a feature problem
            err = rel_err(launch(*problem.args(), impl=impl, **kwargs), problem.reference(exact=exact))
            stats["worst"] = max(stats["worst"], err)
            reason = None if err < tol else f"rel err {err:.3g}"
        except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if reason:
            failures.append(f"FAIL {kernel} ({reason}): {problem.repro()}")
            bar.echo(failures[-1])
            tally["failed"] += 1
        bar.update(1, postfix=f"{kernel}, {tally['failed']} failed")

    check()
    return stats["cases"], stats["worst"], failures


def _specs(pattern: str | None, count: int, seed: int, on_gpu: bool) -> list:
    from ..testing import sample_layer_spec
    from .options import load_pattern

    if pattern:
        return [layer for layer, _ in load_pattern(pattern).distinct_layers()]
    rng = random.Random(seed)
    if on_gpu:
        return [sample_layer_spec(rng, hybrid=bool(i % 2)) for i in range(count)]
    # The interpreter is slow: small heads, few of them.
    return [sample_layer_spec(rng, hybrid=bool(i % 2), head_dims=(64,), ratios=(1, 2)) for i in range(count)]


def _precompile(specs: list, kernels: list[str], page_sizes: list[int]) -> None:
    """Build every kernel the run needs up front, side by side: prefill kernels through
    `prefill.precompile` (their Triton builds in worker processes), decode kernels in threads
    (NVRTC releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..kernels.decode import get_decode_kernel
    from ..kernels.prefill import current_arch, precompile

    with ThreadPoolExecutor(max_workers=8) as pool:
        decode = []
        if "decode" in kernels:
            decode = [
                pool.submit(get_decode_kernel, layer, dtype=torch.bfloat16, page_size=ps)
                for layer, ps in zip(specs, page_sizes)
            ]
        if "prefill" in kernels:
            precompile(specs, (torch.bfloat16,), arch=current_arch())
        for job in decode:
            job.result()


@click.command(name="fuzz")
@click.option("--pattern", default=None, help="Fuzz shapes for this pattern's layers.")
@click.option("--random", "random_specs", is_flag=True, help="Fuzz random specs (hybrid layers included).")
@click.option(
    "--kernel",
    type=click.Choice([*KERNELS, "all"]),
    default="all",
    show_default=True,
    help="Which kernels ('all' runs decode only where a GPU is).",
)
@click.option(
    "--specs",
    "num_specs",
    type=click.IntRange(1),
    default=12,
    show_default=True,
    help="Random specs to draw (with --random); each is one compile per kernel.",
)
@click.option(
    "--examples", type=click.IntRange(1), default=10, show_default=True, help="Shapes per spec and kernel."
)
@click.option(
    "--max-len", type=click.IntRange(1), default=None, help="Longest sequence (default 2048 GPU, 200 CPU)."
)
@click.option("--seed", type=SEED, default=None, help="Seed for the specs and shapes (default: a fresh one).")
@click.option(
    "--features",
    is_flag=True,
    help="With --random --kernel prefill: draw sink tokens, soft-cap, learned sinks, a layer scale and "
    "head dims 32-256, as far as the tl prefill kernel declares them.",
)
def command(pattern, random_specs, kernel, num_specs, examples, max_len, seed, features=False):
    """Fuzz the generated kernels against the reference on this device."""
    if bool(pattern) == random_specs:
        raise click.UsageError("give exactly one of --pattern P or --random")
    if features and (not random_specs or kernel != "prefill"):
        raise click.UsageError(
            "--features needs --random and --kernel prefill (the decode kernels take none yet)"
        )
    on_gpu = env.gpu_capable()
    if kernel == "decode" and not on_gpu:
        raise ImplUnavailableError("the CUDA paged-decode kernel needs an sm_80+ GPU; this machine has none")
    kernels = [k for k in KERNELS if kernel in (k, "all") and (k == "prefill" or on_gpu)]
    # For this run only (a caller's process, e.g. a test's, keeps its own environment):
    # TRITON_INTERPRET is read when the kernel is fetched; outputs are NaN-poisoned.
    overrides = {"SPARSEGEN_POISON_OUTPUT": "1", **({} if on_gpu else {"TRITON_INTERPRET": "1"})}
    with mock.patch.dict(os.environ, overrides), progress.quiet_cache_log():  # the bar shows progress
        _fuzz(pattern, kernel, kernels, num_specs, examples, max_len, seed, on_gpu, features)


def _fuzz(pattern, kernel, kernels, num_specs, examples, max_len, seed, on_gpu, features=False) -> None:
    from ..testing import PAGE_SIZES, decode_problems, prefill_problems  # MissingExtraError without [fuzz]

    from hypothesis import strategies as st  # isort: skip

    seed = random.randrange(2**31) if seed is None else seed
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float16)
    tol = 2e-2 if on_gpu else 5e-3
    max_len = max_len or (2048 if on_gpu else 200)
    specs = _specs(pattern, num_specs, seed, on_gpu)
    if features:
        from ..testing_features import sample_feature_layers

        specs = sample_feature_layers(seed, num_specs, on_gpu)
    where = "GPU, bf16" if on_gpu else "CPU interpreter, fp16"
    skipped = " (decode needs a GPU: not run)" if kernel == "all" and not on_gpu else ""
    log.info(
        f"fuzzing {', '.join(kernels)}{skipped}: {len(specs)} spec(s) x {examples} shapes on the {where}, "
        f"sequences up to {max_len} tokens, seed {seed}"
    )
    page_sizes = [random.Random(seed + i).choice(PAGE_SIZES) for i in range(len(specs))]
    if on_gpu:
        log.info(f"building {len(specs) * len(kernels)} kernels ...")  # the cache's own lines are left out
        _precompile(specs, kernels, page_sizes)
    failed = 0
    bar = progress.bar(len(kernels) * len(specs) * examples, "fuzz", unit="case")
    tally = {"failed": 0}
    for name in kernels:
        cases, worst, failures = 0, 0.0, []
        for i, layer in enumerate(specs):
            if name == "prefill" and features:
                from ..testing_features import feature_problems

                strategy = feature_problems(
                    st.just(layer), max_batch=3, max_len=max_len, dtype=dtype, device=device
                )
            elif name == "prefill":
                strategy = prefill_problems(
                    st.just(layer), max_batch=3, max_len=max_len, dtype=dtype, device=device
                )
            else:
                strategy = decode_problems(
                    st.just(layer),
                    max_batch=4,
                    max_len=4 * max_len,
                    page_sizes=(page_sizes[i],),
                    dtype=dtype,
                    device=device,
                )
            n, w, f = _run(
                name, strategy, examples, tol, exact=not on_gpu, seed=seed + i, bar=bar, tally=tally
            )
            cases, worst, failures = cases + n, max(worst, w), failures + f
        failed += len(failures)
        bar.echo(
            f"{name}: {cases} cases over {len(specs)} spec(s), {len(failures)} failed, worst rel err {worst:.2e}"
        )
    bar.close()
    if skipped:  # part of the result: say what was not checked
        click.echo("decode: not run (the CUDA kernel needs a GPU)")
    log.info(f"seed {seed}: rerun with --seed {seed}")
    if failed:
        raise SystemExit(1)
