"""One tensor-parallel rank's process: build its shard and its `ModelRunner`, then run the driver's steps.

The driver (`executor.MultiprocExecutor`) sends every rank the same commands in the same order:
- `("steps", (messages, collect))`: launch each `steps.StepMessage` in order (forward pass and
  sampler; the tokens stay on the device, where a lookahead step reads them), then, when
  `collect` names a launched step, rank 0 reads that step's tokens and sends them back;
- `("call", (fn, args))`: run `fn(RankContext, *args)`; rank 0 sends its value back;
- `None`: leave.

Every rank samples every row itself. The logits are all-gathered from the vocab-parallel lm_head
and so bitwise the same on every rank (the gather copies, it does not add); seeded rows draw from
a hash of their seed and unseeded rows from the global generator, seeded alike on every rank. So
each rank holds the tokens a lookahead step takes as input without any collective, and only rank
0's are read. Anything a rank raises is reported as a `failures.Failure` and the process exits
at once.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import InputError
from ..runner.config import EngineConfig
from ..runner.inflight import InFlight
from ..runner.model_runner import ModelRunner, default_num_pages, max_step_tokens
from . import distributed
from .failures import Refused, check_pickles, describe
from .sharding import TPShard
from .source import ModelSource
from .steps import RankSequences, StepMessage


@dataclass(frozen=True)
class RankContext:
    """What a function sent with `MultiprocExecutor.call` gets on each rank."""

    info: distributed.RankInfo
    model: Any  # sharding.TensorParallelPhi3Small or decoder_sharding.TensorParallelDecoder
    runner: ModelRunner


def runner_on_rank(
    model, info: distributed.RankInfo, config: EngineConfig, max_model_len: int
) -> ModelRunner:
    """The rank's ModelRunner; by default its cache has the pages that every rank can afford."""
    if config.num_pages is None:  # the driver's scheduler hands out the same pages to every rank
        tokens = max_step_tokens(config, max_model_len)
        mine = default_num_pages(
            model, config.page_size, config.kv_cache_bytes, tokens,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )  # fmt: skip
        config = replace(config, num_pages=distributed.min_int(mine, info.device))
    return ModelRunner(model, config, max_model_len=max_model_len)


class RankSteps:
    """The steps launched on this rank: each one's `InFlight` until rank 0 has sent its tokens."""

    def __init__(self, runner: ModelRunner, rank: int):
        self.runner, self.rank = runner, rank
        self.seqs = RankSequences()
        self.launched: dict[int, InFlight] = {}  # step number -> step (rank 0: until collected)
        self.last: InFlight | None = None  # the newest step: a lookahead step's input tokens
        self.count = 0

    def launch(self, msg: StepMessage) -> None:
        plan = self.seqs.plan(msg)
        eos_token_id = msg[-1]
        after = self.last if plan.lookahead else None
        self.last = self.runner.launch(plan, after, eos_token_id, read_back=self.rank == 0)
        if self.rank == 0:
            self.launched[self.count] = self.last
        self.count += 1

    def collect(self, step: int):
        """Step `step`'s SamplerOutput (rank 0); steps launched before it are never read now."""
        for old in [k for k in self.launched if k < step]:
            del self.launched[old]
        return self.launched.pop(step).output()


def run_command(ctx: RankContext, steps: RankSteps, kind: str, payload) -> tuple[bool, Any]:
    """One command; returns (whether rank 0 answers it, the answer)."""
    if kind == "steps":
        messages, collect = payload
        for msg in messages:
            steps.launch(msg)
        if collect is None:
            return False, None
        return True, steps.collect(collect) if ctx.info.rank == 0 else None
    fn, args = payload  # "call"
    return True, fn(ctx, *args)


def rank_main(rank: int, world: int, port: int, device_type: str, source: ModelSource, config: EngineConfig,
              max_model_len: int, timeout_s: float, seed: int, cmds, out) -> None:  # fmt: skip
    os.environ.update(distributed.rank_env(rank, world, port))
    distributed.ParentWatchdog().start()
    quiet_progress_bars()
    try:
        if device_type == "cpu":  # ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        torch.manual_seed(seed)  # the same global stream on every rank (unseeded sampling)
        info = distributed.init_from_env(device_type)
        group = distributed.new_group(timeout_s)  # the model's collectives: the short timeout
        model = source.build(TPShard(rank, world), info.device, group)
        runner = runner_on_rank(model, info, config, max_model_len)
        out.put(("ready", rank, {"num_pages": runner.cache.num_pages}))
        ctx, steps = RankContext(info, model, runner), RankSteps(runner, rank)
        while (cmd := cmds.get()) is not None:
            answers, value = run_command(ctx, steps, *cmd)
            if rank == 0 and answers:
                if cmd[0] == "call":  # a step's tokens are plain data; a call's value may not pickle
                    try:  # else the queue's feeder thread drops it silently and the driver waits
                        check_pickles(value, f"the result of {cmd[0]!r}")
                    except InputError as exc:
                        value = Refused(describe(exc))
                out.put(("done", 0, value))
    except BaseException as exc:  # report everything, even KeyboardInterrupt, then leave at once
        out.put(("error", rank, describe(exc)))
        leave(out, 1)  # no process-group teardown: peers may be dead, and NCCL's can block
    distributed.shutdown()
    leave(out, 0)


def quiet_progress_bars() -> None:
    """A rank draws no progress bar, but its log lines go through tqdm.write when tqdm is loaded
    (torch loads it), and tqdm's default write lock is a multiprocessing RLock: a named semaphore
    registered with the driver's resource tracker, which `leave`'s os._exit would never
    unregister (the tracker then warns of a leaked semaphore at the driver's exit). A thread
    lock does the same job within one process."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.set_lock(threading.RLock())


def leave(out, code: int) -> None:
    """Flush the report queue and exit without the interpreter's teardown (seconds per rank
    with torch loaded, for nothing: the driver has what it needs)."""
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
