"""One tensor-parallel rank's process: build its shard and engine, then run the driver's commands.

Every rank runs the same engine calls in the same order (see `tp_engine`); only rank 0 sends
values back, each with its engine's `has_unfinished` and `EngineStats` after the call. Anything
a rank raises is reported as a `Failure` and the process exits at once.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from . import distributed
from .engine_stats import engine_stats
from .errors import InputError, SparsegenError
from .tp_failures import Refused, check_pickles, describe


@dataclass(frozen=True)
class RankContext:
    """What a function sent with `TPEngine.call` gets on each rank."""

    info: distributed.RankInfo
    model: Any  # models.tensor_parallel.TensorParallelPhi3Small
    engine: Any  # engine.LLMEngine


def engine_on_rank(model, info, tokenizer, engine_kwargs: dict):
    from .engine import LLMEngine
    from .engine.config import EngineConfig
    from .engine.model_runner import default_num_pages, max_step_tokens

    kw = dict(engine_kwargs)
    kv_bytes = kw.pop("kv_cache_bytes", None)
    if kw.get("num_pages") is None:  # the scheduler must see the same cache size on every rank
        config = EngineConfig(**kw)  # the engine's own arguments, checked as LLMEngine checks them
        max_model_len = config.max_model_len or model.config.max_position_embeddings
        tokens = max_step_tokens(config, max_model_len)
        mine = default_num_pages(model, config.page_size, kv_bytes, tokens)
        kw["num_pages"] = distributed.min_int(mine, info.device)
    return LLMEngine(model, tokenizer=tokenizer, **kw)


def run_command(ctx: RankContext, kind: str, payload):
    """One engine call, the same on every rank and in the same order; rank 0's value is sent."""
    engine = ctx.engine
    if kind == "submit":  # checks everything before queueing: a bad request changes no rank
        try:
            new = engine.submit(*payload)
        except SparsegenError as exc:
            return Refused(describe(exc))
        return [s.seq_id for s in new]
    if kind == "add":  # one request, for a server
        try:
            return engine.add_request(*payload).seq_id
        except SparsegenError as exc:
            return Refused(describe(exc))
    if kind == "step":
        return engine.step()
    if kind == "abort":
        return engine.abort(payload)
    fn, args = payload  # "call"
    return fn(ctx, *args)


def rank_main(rank, world, port, device_type, source, tokenizer, engine_kwargs, warmup, timeout_s,
               seed, cmds, out):  # fmt: skip
    os.environ.update(distributed.rank_env(rank, world, port))
    distributed.ParentWatchdog().start()
    try:
        from .models.tensor_parallel import TPShard

        if device_type == "cpu":  # ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        torch.manual_seed(seed)  # the same global stream on every rank (unseeded sampling)
        info = distributed.init_from_env(device_type)
        group = distributed.new_group(timeout_s)  # the model's collectives: the short timeout
        model = source.build(TPShard(rank, world), info.device, group)
        engine = engine_on_rank(model, info, tokenizer, engine_kwargs)
        seconds = engine.warmup() if warmup else 0.0
        ready = {"warmup_s": seconds, "max_model_len": engine.max_model_len, "kv_capacity": engine.kv_capacity,
                 "stats": engine_stats(engine)}  # fmt: skip
        out.put(("ready", rank, ready))
        ctx = RankContext(info, model, engine)
        while (cmd := cmds.get()) is not None:
            value = run_command(ctx, *cmd)
            if rank == 0:
                try:  # else the queue's feeder thread drops it silently and the driver waits
                    check_pickles(value, f"the result of {cmd[0]!r}")
                except InputError as exc:
                    value = Refused(describe(exc))
                out.put(("done", 0, (value, engine.has_unfinished, engine_stats(engine))))
    except BaseException as exc:  # report everything, even KeyboardInterrupt, then leave at once
        out.put(("error", rank, describe(exc)))
        leave(out, 1)  # no process-group teardown: peers may be dead, and NCCL's can block
    distributed.shutdown()
    leave(out, 0)


def leave(out, code: int) -> None:
    """Flush the report queue and exit without the interpreter's teardown (seconds per rank
    with torch loaded, for nothing: the driver has what it needs)."""
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
