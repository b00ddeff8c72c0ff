"""`TPEngine`: the decoding engine over N tensor-parallel processes, driven from this one.

    with TPEngine(ModelSource(model_dir="ckpt"), 2, device="cuda") as engine:
        results = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=32))

This process (the driver) spawns ranks 0..N-1 with torch.multiprocessing (each with torchrun's
variables, see `sparsegen.distributed`), sends every rank the same commands over a queue, and
gets rank 0's answers and any rank's errors back over another. This module is the driver; a
rank's process is `tp_rank`, the weights every rank builds are described by `tp_source`, and a
rank's failure travels back as `tp_failures.Failure`.

**Scheduling: every rank runs the scheduler and the sampler itself, deterministically.** Each
rank holds an `LLMEngine` over its shard of the model and its own KV cache (its KV groups only,
with the same number of pages on every rank: the smallest any rank can afford). Given the same
requests, the scheduler's plans depend only on the tokens sampled so far, and the tokens depend
only on the logits, which are all-gathered from the vocab-parallel lm_head and so bitwise the
same on every rank (the gather copies, it does not add). Seeded requests draw from per-request
generators; unseeded ones from the global generator, seeded identically on every rank. So no
plan is broadcast each step: the per-step cost of tensor parallelism is the model's collectives
only (two all-reduces per layer and one all-gather), which CUDA graphs capture. The price is
that every rank must see the same engine calls in the same order: the driver sends each call
(`submit`, `add`, `step`, `abort`, `results`, `call`) to every rank's queue and takes rank 0's answer,
so `TPEngine` offers `LLMEngine`'s surface (a request that one rank refuses, every rank refuses
alike, and none is changed). Each `step()` costs one queue round trip besides the forward;
`call(fn)` runs a whole loop on the ranks without it (the benchmarks use that).

**Failures never hang.** The driver polls the ranks while it waits: a rank that exits (crash,
kill, OOM) or reports an exception makes the driver stop the others and raise one error naming
the rank, within about a second; a rank that is alive but stuck in a collective is ended by the
collective's timeout (`timeout_s`); a rank whose driver is gone ends itself
(`distributed.ParentWatchdog`). After a failure the engine is closed.
"""

from __future__ import annotations

import queue
import secrets
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from . import distributed
from .engine_stats import EngineStats
from .errors import DistributedError, InputError
from .log import get_logger
from .tp_failures import Failure, Refused, check_pickles, exit_text, reraise
from .tp_failures import describe as _describe  # noqa: F401 - tests import these two from here
from .tp_failures import reraise as _reraise  # noqa: F401
from .tp_rank import RankContext, rank_main
from .tp_source import ModelSource

log = get_logger(__name__)

POLL_S = 0.2  # how often the driver checks that every rank is alive while it waits
GRACE_S = 1.0  # after a first failure, how long to collect the other ranks' reports
STOP_S = 10.0  # how long close() waits for ranks to exit before killing them


@dataclass(frozen=True)
class RequestHandle:
    """What `TPEngine.submit` returns per prompt: the request id that `abort` takes."""

    seq_id: int


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def check_tensor_parallel(config, tensor_parallel_size: object, device_type: str) -> int:
    """The tensor-parallel size, checked against the model and the devices before any rank starts:
    it must divide the KV heads (whole KV groups per rank) and the GeGeLU units, and fit the GPUs."""
    world = distributed.check_tp_size(tensor_parallel_size, config.num_key_value_heads, device_type)
    if config.ff_intermediate_size % world:
        raise InputError(
            f"tensor_parallel_size {world} does not divide ff_intermediate_size {config.ff_intermediate_size}"
        )
    return world


class TPEngine:
    """`LLMEngine`'s `generate` and `warmup`, run by `tensor_parallel_size` ranks."""

    def __init__(
        self,
        source: ModelSource,
        tensor_parallel_size: int,
        *,
        device: str = "cpu",
        tokenizer=None,
        warmup: bool = False,
        timeout_s: float = distributed.DEFAULT_TIMEOUT_S,
        **engine_kwargs,
    ):
        device_type = torch.device(device).type
        config = self.model_config = source.load_config()
        self.world_size = check_tensor_parallel(config, tensor_parallel_size, device_type)
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else config.eos_token_id
        self.warmup_s = 0.0
        self._closed = False
        ctx = torch.multiprocessing.get_context("spawn")
        self._out = ctx.Queue()
        self._cmds = [ctx.Queue() for _ in range(self.world_size)]
        args = (self.world_size, distributed.free_port(), device_type, source, tokenizer, engine_kwargs,
                warmup, timeout_s, secrets.randbits(62))  # fmt: skip
        self._procs = [
            ctx.Process(target=rank_main, args=(r, *args, self._cmds[r], self._out), name=f"sparsegen-tp{r}")
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._finalizer = weakref.finalize(self, _terminate, self._procs)
        ready = self._wait(want="ready")
        self.warmup_s = max(r["warmup_s"] for r in ready)
        self.max_model_len = ready[0]["max_model_len"]
        self.kv_capacity: tuple[int, int] = ready[0]["kv_capacity"]  # (pages, tokens), as LLMEngine's
        self._stats: EngineStats = ready[0]["stats"]
        self.has_unfinished = False
        self._aborted: set[int] | None = None  # while generate() runs: its requests that were aborted

    # -- waiting on the ranks -------------------------------------------------------------------
    def _wait(self, want: str):
        ready: dict[int, dict] = {}
        while True:
            try:
                kind, rank, value = self._out.get(timeout=POLL_S)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if p.exitcode is not None}
                if dead:
                    self._fail({}, dead)
                continue
            if kind == "error":
                self._fail({rank: value}, {})
            elif kind == "ready" and want == "ready":
                ready[rank] = value
                if len(ready) == self.world_size:
                    return [ready[r] for r in range(self.world_size)]
            elif kind == "done" and want == "done":
                return value

    def _fail(self, errors: dict[int, Failure], dead: dict[int, int]) -> None:
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and len(errors) + len(dead) < self.world_size:
            try:
                kind, rank, value = self._out.get(timeout=0.05)
                if kind == "error":
                    errors.setdefault(rank, value)
            except queue.Empty:
                pass
        for r, p in enumerate(self._procs):  # gone before we stop the rest, without a report
            if r not in errors and p.exitcode is not None:
                dead.setdefault(r, p.exitcode)
        self.close(kill=True)
        lost = [f"rank {r} {exit_text(c)}" for r, c in sorted(dead.items()) if r not in errors]
        # The cause: a rank's own exception rather than a peer's broken collective, else a lost rank.
        causes = [r for r, f in sorted(errors.items()) if f.name != "DistributedError"]
        if causes:
            r = causes[0]
            if errors[r].name not in ("InputError", "CheckpointError", "TokenizerError", "CacheOutOfMemory"):
                log.error("tensor-parallel rank %d failed:\n%s", r, errors[r].traceback.rstrip())
            others = f" (also: {'; '.join(lost)})" if lost else ""
            raise reraise(r, errors[r], others) from None
        if lost:
            seen = (
                f"; rank {min(errors)} saw: {errors[min(errors)].message.splitlines()[0]}" if errors else ""
            )
            raise DistributedError(f"tensor-parallel {', '.join(lost)}; the other ranks were stopped{seen}")
        r = min(errors)
        raise reraise(r, errors[r], "")

    def _run(self, kind: str, payload):
        if self._closed:
            raise DistributedError(
                "this tensor-parallel engine is closed (a rank failed, or close() was called)"
            )
        check_pickles((kind, payload), f"{kind}'s arguments")  # else the queue drops them silently
        for q in self._cmds:
            q.put((kind, payload))
        value, self.has_unfinished, self._stats = self._wait(want="done")  # rank 0's, after the call
        if isinstance(value, Refused):
            raise reraise(0, value.failure, "")
        return value

    # -- the LLMEngine-like surface ---------------------------------------------------------------
    def submit(self, prompts: Seq[list[int]], params) -> list[RequestHandle]:
        """Queue the prompts on every rank (checked first there: all or none, as LLMEngine.submit)."""
        return [RequestHandle(i) for i in self._run("submit", (prompts, params))]

    def add_request(self, prompt_ids: list[int], params) -> RequestHandle:
        """Queue one request on every rank (checked first there), as LLMEngine.add_request; its
        result is never kept on the ranks (a server reads its TokenEvents instead)."""
        return RequestHandle(self._run("add", (prompt_ids, params)))

    def stats(self) -> EngineStats:
        """Rank 0's EngineStats after the last call (every rank schedules alike)."""
        return self._stats

    def step(self) -> list:
        """One forward pass on every rank; rank 0's TokenEvents."""
        return self._run("step", None)

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request on every rank (before the next step). False once the engine
        is closed: nothing is unfinished then (so cleanup after a failure does not raise again)."""
        if self._closed:
            return False
        done = self._run("abort", request_id)
        if done and self._aborted is not None:
            self._aborted.add(request_id)
        return done

    def results(self, handles: Seq[RequestHandle]) -> list:
        """Rank 0's GenerationResult per handle (each can be taken once, when it is done)."""
        return self._run("results", [h.seq_id for h in handles])

    def generate(self, prompts: Seq[list[int]], params, on_token: Callable | None = None):
        """LLMEngine.generate over the ranks: results in input order; `on_token` sees each of
        these requests' TokenEvents (and may `abort` a request, as stop strings do)."""
        handles = self.submit(prompts, params)
        left = {h.seq_id for h in handles}
        self._aborted = set()
        try:
            while left:
                for event in self.step():
                    if event.request_id in left:
                        if event.error is not None:  # failed inside a step: the call fails
                            raise event.error
                        if event.finish_reason is not None:
                            left.discard(event.request_id)
                        if on_token is not None:
                            on_token(event)
                left = {i for i in left if i not in self._aborted}
                if left and not self.has_unfinished:
                    raise DistributedError(f"requests {sorted(left)} are unfinished, but every rank is idle")
        finally:
            self._aborted = None
            for i in left:
                self.abort(i)
        return self.results(handles)

    def warmup(self) -> float:
        """Kernel builds and first graph captures ran when the ranks started (`warmup=True`);
        this returns how long that took on the slowest rank, or runs one now."""
        if self.warmup_s:
            return self.warmup_s
        start = time.perf_counter()
        self.call(_warmup)
        return time.perf_counter() - start

    def call(self, fn: Callable, *args):
        """Run `fn(RankContext, *args)` on every rank (a module-level function, so it pickles);
        returns rank 0's result. For inspection, tests and benchmarks."""
        return self._run("call", (fn, args))

    def close(self, kill: bool = False) -> None:
        if not self._closed:
            self._closed = True
            if not kill:
                for q in self._cmds:
                    q.put(None)
                deadline = time.monotonic() + STOP_S
                for p in self._procs:
                    p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def __enter__(self) -> TPEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def tp_engine_for(model_dir, random, tokenizer_path, device, dtype, force_dense, seed, tp, engine_options):
    """`LLM(..., tensor_parallel_size=tp)`'s engine: a TPEngine over the same weights and tokenizer
    that `llm.build_model` would give one process."""
    from .llm import build_tokenizer

    tokenizer = build_tokenizer(model_dir, random, tokenizer_path)
    source = ModelSource(
        model_dir=str(model_dir) if model_dir is not None else None,
        random=random,
        seed=seed,
        dtype=str(dtype).removeprefix("torch."),
        force_dense=force_dense,
        dummy_token_indices=tokenizer.dummy_token_indices if tokenizer is not None else (),
    )
    return TPEngine(source, tp, device=str(device), tokenizer=tokenizer, **engine_options)


def _warmup(ctx: RankContext) -> float:
    return ctx.engine.warmup()


__all__ = ["ModelSource", "RankContext", "TPEngine", "check_tensor_parallel"]
