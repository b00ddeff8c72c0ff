"""`sparsegen fuzz`: hypothesis-driven checks of the generated kernels against the reference.

The specs are fixed first (a pattern's distinct layers, or `--specs N` random layers drawn from
the seed by `sparsegen.testing`'s strategies), so each costs one compile per kernel; hypothesis
then draws up to `--examples` shapes and data for every spec and kernel (`fuzz_check`). On a GPU
the compiled kernels run in bf16 and are checked against the reference in float32 on the GPU;
on a CPU the prefill kernel runs in Triton's interpreter (fp16, small shapes) against float64,
and the CUDA decode kernel is not run. Outputs are NaN-poisoned before every launch, so a row a
kernel forgets to write fails, and every (row, head) is held to its dtype's tolerance. A spec's
first failure prints as a one-line repro; hypothesis then shrinks it, and the minimal failing
example is reported (spec JSON, shapes, data seed). The run ends with one line per kernel
(cases, failing specs, worst global error) and the seed; any failure exits 1.
"""

from __future__ import annotations

import os
import secrets
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


def _draw(strategy, seed: int, count: int) -> list:
    """`count` distinct values of a hypothesis `strategy`, drawn reproducibly from `seed` (the
    first is the strategy's simplest value, as hypothesis tries that first)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    out: list = []

    @hseed(seed)
    @settings(max_examples=20 * count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(value):
        if len(out) < count and value not in out:
            out.append(value)

    draw()
    return out


def _specs(pattern: str | None, count: int, seed: int, on_gpu: bool) -> list:
    """A pattern's distinct layers, or `count` random ones drawn by `sparsegen.testing.layer_specs`
    (Phi-3 style and hybrid layers; the interpreter gets head dim 64 and group sizes 1-2)."""
    from ..testing import layer_specs  # MissingExtraError without [fuzz], before hypothesis is imported
    from .options import load_pattern

    from hypothesis import strategies as st  # isort: skip

    if pattern:
        return [layer for layer, _ in load_pattern(pattern).distinct_layers()]
    region = {"head_dims": (64, 96, 128), "gqa_ratios": (1, 2, 3, 4, 8)} if on_gpu else {
        "head_dims": (64,), "gqa_ratios": (1, 2)}  # fmt: skip
    return _draw(
        st.one_of(layer_specs(hybrid=False, **region), layer_specs(hybrid=True, **region)), seed, count
    )


def _page_sizes(seed: int, count: int) -> list[int]:
    """One page size per spec (each decode spec is one compile), drawn from the seed."""
    from ..testing import PAGE_SIZES

    from hypothesis import strategies as st  # isort: skip

    return _draw(st.lists(st.sampled_from(PAGE_SIZES), min_size=count, max_size=count), seed + 1, 1)[0]


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
@click.option(
    "--shrink/--no-shrink",
    default=True,
    show_default=True,
    help="Shrink a spec's first failure to a minimal failing example (the spec JSON, shapes, seed).",
)
def command(pattern, random_specs, kernel, num_specs, examples, max_len, seed, features=False, shrink=True):
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
        _fuzz(pattern, kernel, kernels, num_specs, examples, max_len, seed, on_gpu, features, shrink)


def _fuzz(
    pattern, kernel, kernels, num_specs, examples, max_len, seed, on_gpu, features=False, shrink=True
) -> None:
    from ..testing import decode_problems, prefill_problems  # MissingExtraError without [fuzz]

    from hypothesis import strategies as st  # isort: skip

    from . import fuzz_check

    seed = secrets.randbelow(2**31) if seed is None else seed
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float16)
    max_len = max_len or (2048 if on_gpu else 200)
    if features:
        from ..testing_features import sample_feature_layers

        specs = sample_feature_layers(seed, num_specs, on_gpu)
    else:
        specs = _specs(pattern, num_specs, seed, on_gpu)
    where = "GPU, bf16" if on_gpu else "CPU interpreter, fp16"
    skipped = " (decode needs a GPU: not run)" if kernel == "all" and not on_gpu else ""
    log.info(
        f"fuzzing {', '.join(kernels)}{skipped}: {len(specs)} spec(s) x {examples} shapes on the {where}, "
        f"sequences up to {max_len} tokens, seed {seed}"
    )
    page_sizes = _page_sizes(seed, len(specs))
    if on_gpu:
        log.info(f"building {len(specs) * len(kernels)} kernels ...")  # the cache's own lines are left out
        _precompile(specs, kernels, page_sizes)
    failed = 0
    bar = progress.bar(len(kernels) * len(specs) * examples, "fuzz", unit="case")
    tally = {"failed": 0}
    for name in kernels:
        cases, worst, reports = 0, 0.0, []
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

            def first(failure, name=name):
                tally["failed"] += 1
                bar.echo(f"FAIL {name} ({failure.reason}): {failure.problem.repro()}")
                if shrink:
                    bar.note(f"{name}: shrinking a failure")

            result = fuzz_check.check_spec(
                name, strategy, examples=examples, dtype=dtype, exact=not on_gpu, seed=seed + i, shrink=shrink,
                on_case=lambda name=name: bar.update(1, postfix=f"{name}, {tally['failed']} failed"),
                on_first=first,
            )  # fmt: skip
            bar.update(examples - result.cases)  # a spec stops exploring at its first failure
            cases, worst = cases + result.cases, max(worst, result.worst)
            if result.first is not None:
                reports.append(fuzz_check.report(name, i + 1, len(specs), seed, result))
        failed += len(reports)
        for lines in reports:
            for line in lines:
                bar.echo(line)
        bar.echo(
            f"{name}: {cases} cases over {len(specs)} spec(s), {len(reports)} failed, worst rel err {worst:.2e}"
        )
    bar.close()
    if skipped:  # part of the result: say what was not checked
        click.echo("decode: not run (the CUDA kernel needs a GPU)")
    log.info(f"seed {seed}: rerun with --seed {seed}")
    if failed:
        raise SystemExit(1)
