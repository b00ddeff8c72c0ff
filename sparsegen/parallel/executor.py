"""`MultiprocExecutor`: the engine's executor over N tensor-parallel rank processes, driven from this one.

    engine = LLMEngine(ModelSource(model_dir="ckpt"), tensor_parallel_size=2, device="cuda")

`LLMEngine` picks this executor (engine.executor) and keeps everything else in this process
(the driver): the scheduler, the page allocator, the sampling parameters and the results. This
module spawns ranks 0..N-1 with torch.multiprocessing (each with torchrun's variables, see
`distributed`). Each rank runs a `ModelRunner` over its shard of the weights (`source`,
`sharding`) and its own KV cache of its KV groups, with the same number of pages on every rank
(the smallest any rank can afford), which is the number the driver's scheduler hands out.

**A step.** `launch(plan)` encodes the plan for the ranks (`steps.StepMessage`: sequence ids and
what changed since the last step) and keeps it; reading the step's tokens (`InFlight.output()`)
sends every kept message and "collect this step" in one command to every rank's queue, and waits
for rank 0's tokens on the answer queue. The engine launches a lookahead decode step before it
reads the step in flight (runner.inflight), so the ranks launch step n+1 before rank 0 reads step
n, and the GPUs go from one step to the next without waiting for the driver. The per-step cost of
tensor parallelism is one queue round trip and the model's collectives (two all-reduces per layer
and one all-gather), which the ranks' CUDA graphs capture.

**Failures never hang.** The driver polls the ranks while it waits: a rank that exits (crash,
kill, OOM) or reports an exception makes the driver stop the others and raise one error naming
the rank, within about a second; a rank that is alive but stuck in a collective is ended by the
collective's timeout (`EngineConfig.collective_timeout_s`); a rank whose driver is gone ends
itself (`distributed.ParentWatchdog`). After a failure the executor is closed, and every later
step raises `DistributedError`.
"""

from __future__ import annotations

import queue
import secrets
import time
import weakref
from collections.abc import Callable

import torch

from ..errors import DistributedError, InputError
from ..models.config import Phi3SmallConfig
from ..request.sampling_params import SamplerOutput
from ..request.sequence import Plan
from ..runner.config import EngineConfig
from ..runner.inflight import InFlight
from ..runner.kv_cache import CachePages
from . import distributed
from .failures import Refused, check_pickles, collect_reports, failure_error, reraise
from .rank import rank_main
from .source import ModelSource
from .steps import StepEncoder, StepMessage

POLL_S = 0.2  # how often the driver checks that every rank is alive while it waits
STOP_S = 10.0  # how long close() waits for ranks to exit before killing them


def check_tensor_parallel(config, tensor_parallel_size: object, device_type: str) -> int:
    """The tensor-parallel size, checked against the model and the devices before any rank starts:
    it must divide the KV heads (whole KV groups per rank) and the MLP's (or every expert's)
    intermediate units, and fit the GPUs. The field named is config.json's."""
    world = distributed.check_tp_size(tensor_parallel_size, config.num_key_value_heads, device_type)
    field = "ff_intermediate_size" if isinstance(config, Phi3SmallConfig) else "intermediate_size"
    if config.ff_intermediate_size % world:
        raise InputError(
            f"tensor_parallel_size {world} does not divide {field} {config.ff_intermediate_size}"
        )
    return world


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


class RankOutput:
    """A step's tokens as rank 0 will send them (`runner.inflight.PendingOutput`)."""

    def __init__(self, executor: MultiprocExecutor, step: int):
        self.executor, self.step = executor, step

    def output(self) -> SamplerOutput:
        return self.executor.collect(self.step)


class MultiprocExecutor:
    """`engine.executor.Executor` over `config.tensor_parallel_size` rank processes."""

    def __init__(self, source: ModelSource, config: EngineConfig, *, max_model_len: int, device_type: str):
        self.world_size = config.tensor_parallel_size
        self._closed = False
        ctx = torch.multiprocessing.get_context("spawn")
        self._out = ctx.Queue()
        self._cmds = [ctx.Queue() for _ in range(self.world_size)]
        timeout_s = config.collective_timeout_s or distributed.DEFAULT_TIMEOUT_S
        args = (self.world_size, distributed.free_port(), device_type, source, config, max_model_len, timeout_s,
                secrets.randbits(62))  # fmt: skip
        self.procs = [
            ctx.Process(target=rank_main, args=(r, *args, self._cmds[r], self._out), name=f"sparsegen-tp{r}")
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()
        self._finalizer = weakref.finalize(self, _terminate, self.procs)
        ready = self._wait("ready")
        self.cache = CachePages(ready[0]["num_pages"], config.page_size)  # every rank's page count
        self._encoder = StepEncoder()
        self._unsent: list[StepMessage] = []
        self._launched = 0  # steps launched so far; the next one's number

    # -- steps ----------------------------------------------------------------------------------
    def launch(self, plan: Plan, after: InFlight | None, eos_token_id: int | None) -> InFlight:
        """Encode `plan` for the ranks; it is sent with the next command (see the module
        docstring). A lookahead plan's input tokens are the newest step's, which the ranks hold
        (`after` is that step)."""
        self._check_open()
        self._unsent.append(self._encoder.encode(plan, eos_token_id))
        step, self._launched = self._launched, self._launched + 1
        return InFlight(plan, None, RankOutput(self, step) if plan.sampled or plan.scores_prompt else None)

    def collect(self, step: int) -> SamplerOutput:
        """Send the launched steps not sent yet, and wait for step `step`'s tokens from rank 0."""
        self._check_open()
        messages, self._unsent = tuple(self._unsent), []
        self._send("steps", (messages, step))
        return self._answer()

    def call(self, fn: Callable, *args):
        """Run `fn(rank.RankContext, *args)` on every rank (a module-level function, so it pickles)
        after the steps launched so far; returns rank 0's result. For inspection, tests and
        benchmarks."""
        self._check_open()
        check_pickles((fn, args), "call's arguments")  # else the queue drops them silently
        if self._unsent:
            messages, self._unsent = tuple(self._unsent), []
            self._send("steps", (messages, None))
        self._send("call", (fn, args))
        return self._answer()

    def _check_open(self) -> None:
        if self._closed:
            raise DistributedError(
                "this tensor-parallel engine is closed (a rank failed, or close() was called)"
            )

    def _send(self, kind: str, payload) -> None:
        for q in self._cmds:
            q.put((kind, payload))

    def _answer(self):
        value = self._wait("done")
        if isinstance(value, Refused):
            raise reraise(0, value.failure, "")
        return value

    # -- waiting on the ranks -------------------------------------------------------------------
    def _wait(self, want: str):
        ready: dict[int, dict] = {}
        while True:
            try:
                kind, rank, value = self._out.get(timeout=POLL_S)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode is not None}
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

    def _fail(self, errors: dict, dead: dict[int, int]) -> None:
        """Collect the other ranks' reports for a moment, stop every rank, raise the cause."""
        collect_reports(self._out, errors, dead, self.procs)
        self.close(kill=True)
        raise failure_error(errors, dead) from None

    def close(self, kill: bool = False) -> None:
        """Let the ranks leave (or, with `kill`, stop them now) and wait for them."""
        if not self._closed:
            self._closed = True
            if not kill:
                for q in self._cmds:
                    q.put(None)
                deadline = time.monotonic() + STOP_S
                for p in self.procs:
                    p.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()
