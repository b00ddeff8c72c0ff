"""`sparsegen fuzz`: hypothesis-driven checks of the generated prefill kernels vs the reference.

On a GPU the compiled kernels run in bf16; on a CPU the generated kernels run in Triton's
interpreter (fp16, small shapes). Each failing case prints as a one-line repro.
"""

from __future__ import annotations

import os

import click
import torch


def _run(strategy, examples: int, impl: str, tol: float, seed: int | None) -> tuple[int, list[str]]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from .. import ops
    from ..testing import rel_err

    failures: list[str] = []
    count = [0]

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(problem):
        count[0] += 1
        try:
            err = rel_err(ops.prefill(*problem.args(), impl=impl), problem.reference())
            reason = None if err < tol else f"rel err {err:.3g}"
        except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if reason:
            failures.append(f"FAIL ({reason}): {problem.repro()}")
            click.echo(failures[-1])

    if seed is not None:
        check = hseed(seed)(check)
    check()
    return count[0], failures


@click.command(name="fuzz")
@click.option("--pattern", default=None, help="Fuzz shapes for this pattern's layers.")
@click.option("--random", "random_specs", is_flag=True, help="Fuzz random specs (hybrid layers included).")
@click.option("--examples", type=click.IntRange(1), default=25, show_default=True)
@click.option(
    "--max-len", type=click.IntRange(1), default=None, help="Longest sequence (default 2048 GPU, 200 CPU)."
)
@click.option("--seed", type=int, default=None, help="Hypothesis seed for a reproducible run.")
def command(pattern, random_specs, examples, max_len, seed):
    """Fuzz the generated kernels against the reference on this device."""
    if bool(pattern) == random_specs:
        raise click.UsageError("give exactly one of --pattern P or --random")
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is fetched
    from hypothesis import strategies as st

    from ..testing import layer_specs, prefill_problems
    from .options import load_pattern

    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float16)
    tol = 2e-2 if on_gpu else 5e-3
    max_len = max_len or (2048 if on_gpu else 200)
    if pattern:
        layers = st.sampled_from([layer for layer, _ in load_pattern(pattern).distinct_layers()])
    else:
        layers = layer_specs(head_dims=(64, 96, 128) if on_gpu else (64,), block_sizes=(16, 32, 64, 128))
    where = "GPU, bf16" if on_gpu else "CPU interpreter, fp16"
    click.echo(f"fuzzing {examples} cases on the {where}, sequences up to {max_len} tokens", err=True)
    strategy = prefill_problems(layers, max_batch=3, max_len=max_len, dtype=dtype, device=device)
    n, failures = _run(strategy, examples, "triton", tol, seed)
    click.echo(f"{n} cases, {len(failures)} failed", err=True)
    if failures:
        raise SystemExit(1)
