"""One spec's fuzz check for `sparsegen fuzz`: hypothesis draws shapes and data for the spec,
sees every failure, and shrinks the first one it finds to a minimal failing example.

A case fails when the kernel raises, or when any (row, head) of its output is over the per-row
tolerance of its dtype against the reference (`testing.row_mismatch`), so a bug confined to one
tile, head or page fails although the global error norm is small. Every failure is raised from
one place as `Mismatch`, so hypothesis treats them as one bug and may shrink a wrong-value case
into a smaller one that raises (the reason says which). The last failing call is hypothesis'
final replay of the shrunk example: that is the example reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FuzzMismatch as Mismatch


@dataclass
class Failure:
    problem: object  # a PrefillProblem, DecodeProblem or FeatureProblem
    reason: str


@dataclass
class SpecResult:
    """What one spec's check saw: exploration cases (shrink replays not counted), the worst
    global relative error among them, the first failure and the shrunk one (None: no failure)."""

    cases: int = 0
    worst: float = 0.0
    first: Failure | None = None
    minimal: Failure | None = None
    shrink_steps: int = 0  # calls after the first failure (shrink attempts and the final replay)
    flaky: str = field(default="")  # hypothesis could not replay the failure (nondeterministic kernel)


def _reason(launch, impl: str, problem, dtype, exact: bool, result: SpecResult) -> str | None:
    from ..testing import rel_err, row_mismatch

    try:
        kwargs = problem.kwargs() if hasattr(problem, "kwargs") else {}  # sinks= of a feature problem
        out = launch(*problem.args(), impl=impl, **kwargs)
        ref = problem.reference(exact=exact)
        err = rel_err(out, ref)
        if result.first is None:
            result.worst = max(result.worst, err)
        return row_mismatch(out, ref, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - a kernel error is a failing case like a wrong value
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {text}"


def check_spec(kernel: str, strategy, *, examples: int, dtype, exact: bool, seed: int, shrink: bool,
               on_case=None, on_first=None) -> SpecResult:  # fmt: skip
    """Run up to `examples` cases of `strategy` (seeded by `seed`, so a rerun draws the same
    ones); at the first failure hypothesis stops exploring and (with `shrink`) shrinks it.
    `on_case()` is called after each exploration case, `on_first(failure)` at the first failure."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import FlakyFailure, FlakyReplay

    from .. import ops

    launch = ops.prefill if kernel == "prefill" else ops.paged_decode
    impl = "triton" if kernel == "prefill" else "cuda"
    result = SpecResult()
    phases = (Phase.explicit, Phase.generate, *((Phase.shrink,) if shrink else ()))

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=phases, derandomize=False,
              report_multiple_bugs=False, print_blob=False, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def check(problem):
        exploring = result.first is None
        reason = _reason(launch, impl, problem, dtype, exact, result)
        if exploring:
            result.cases += 1
        else:
            result.shrink_steps += 1
        if reason is not None:
            result.minimal = Failure(problem, reason)
            if exploring:
                result.first = result.minimal
                if on_first is not None:
                    on_first(result.first)
        if exploring and on_case is not None:
            on_case()
        if reason is not None:
            raise Mismatch(reason)

    try:
        check()
    except Mismatch:
        pass
    except (FlakyFailure, FlakyReplay) as exc:
        result.flaky = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result.minimal = result.first
    return result


def _base(problem):
    return getattr(problem, "problem", problem)  # a FeatureProblem wraps a PrefillProblem


def shapes(problem) -> str:
    """The example's shapes in words: q_lens/k_lens of a prefill, seq_lens/page_size of a decode."""
    p = _base(problem)
    if hasattr(p, "q_lens"):
        return f"q_lens={p.q_lens} k_lens={p.k_lens}"
    return f"seq_lens={p.seq_lens} page_size={p.page_size}"


def size(problem) -> tuple[int, int]:
    """(batch, total tokens) of an example: the order in which a shrunk example is smaller."""
    p = _base(problem)
    lens = p.k_lens if hasattr(p, "k_lens") else p.seq_lens
    return len(lens), sum(lens)


def report(kernel: str, spec_no: int, specs: int, run_seed: int, result: SpecResult) -> list[str]:
    """The lines that report one spec's failure: the first failure found, then the minimal
    example (its spec JSON, shapes, data seed, scale and dtype, and a repro line)."""
    first, low = result.first, result.minimal
    assert first is not None and low is not None
    p = _base(low.problem)
    how = (
        f"after {result.shrink_steps} shrink step(s)"
        if not result.flaky
        else f"not shrunk, the failure did not replay ({result.flaky})"
    )
    lines = [
        f"minimal failing example ({kernel}, spec {spec_no} of {specs}, run seed {run_seed}, {how}): {low.reason}",
        f"  spec: {p.layer.to_json()}",
        f"  shapes: {shapes(low.problem)} (first failure: {shapes(first.problem)})",
        f"  data seed: {p.seed}, scale: {p.scale}, dtype: {p.dtype}",
        f"  repro: {low.problem.repro()}",
    ]
    return lines
