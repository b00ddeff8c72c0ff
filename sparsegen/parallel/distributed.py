"""Process groups for tensor parallelism: set-up from torchrun's variables, collectives, watchdogs.

A rank learns who it is from the variables torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`MASTER_ADDR`, `MASTER_PORT`); `parallel.executor` sets the same ones in the processes it
spawns, so a rank runs the same way under either launcher. The backend is NCCL on GPUs and
gloo on CPUs, and `NCCL_NVLS_ENABLE=0` is always set before NCCL starts (NVLink multicast must
stay off on the machines this runs on).

Nothing here may hang forever:
- every collective has the group's timeout, and a failed or timed-out collective raises
  `DistributedError` naming the rank and the operation (a peer that dies usually breaks gloo's
  sockets at once; one that is alive but stuck is caught by the timeout);
- `ParentWatchdog` ends a spawned rank whose launching process has gone away.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DistributedError, InputError
from ..log import get_logger

log = get_logger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # per collective while running: a cold kernel build on one rank must fit
START_TIMEOUT_S = 900.0  # joining the group: every rank imports torch and loads its weights first
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
EXIT_PARENT_GONE = 70


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" | "gloo"
    device: torch.device

    @property
    def is_driver(self) -> bool:
        """Rank 0 reports results; every rank computes the same steps."""
        return self.rank == 0


def check_tp_size(tp: object, num_kv_heads: int, device_type: str, device_count: int | None = None) -> int:
    """The tensor-parallel size, checked before any process starts: an int >= 1 that divides the
    KV heads (each rank holds whole KV groups) and, on GPUs, at most the visible devices."""
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise InputError(f"tensor_parallel_size must be an int, got {tp!r}")
    if tp < 1:
        raise InputError(f"tensor_parallel_size must be >= 1, got {tp}")
    if num_kv_heads % tp:
        raise InputError(
            f"tensor_parallel_size {tp} does not divide the model's {num_kv_heads} KV heads "
            "(config.json's num_key_value_heads; each rank holds whole KV groups)"
        )
    if device_type == "cuda":
        count = torch.cuda.device_count() if device_count is None else device_count
        if tp > count:
            raise InputError(f"tensor_parallel_size {tp} needs {tp} GPUs, but {count} are visible")
    return tp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun would set for `rank` on a single host."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise DistributedError(f"{name} is not set; start ranks with torchrun or sparsegen's --tp")
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an int") from None


def set_nccl_env() -> None:
    """NVLink multicast (NVLS) off, whatever the caller's environment says."""
    if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
        log.warning("NCCL_NVLS_ENABLE=%s overridden to 0", os.environ["NCCL_NVLS_ENABLE"])
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def init_from_env(device_type: str, timeout_s: float = START_TIMEOUT_S) -> RankInfo:
    """Join the process group described by torchrun's variables; NCCL on cuda, gloo on cpu."""
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    if not 0 <= rank < world:
        raise DistributedError(f"RANK={rank} is outside 0..WORLD_SIZE-1 ({world - 1})")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        set_nccl_env()
        if local >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local}, but {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
        kwargs = {"device_id": device}  # eager communicator set-up: the first step is not a surprise
    elif device_type == "cpu":
        device, backend, kwargs = torch.device("cpu"), "gloo", {}
    else:
        raise InputError(f"tensor parallelism runs on 'cuda' or 'cpu', not {device_type!r}")
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    except Exception as exc:
        raise DistributedError(
            f"rank {rank}: cannot join the {backend} process group: {_first_line(exc)}"
        ) from None
    return RankInfo(rank, world, local, backend, device)


def new_group(timeout_s: float):
    """A group of every rank whose collectives time out after `timeout_s` (the model's)."""
    try:
        return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise _failed("creating a process group", exc) from None


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _failed(op: str, exc: BaseException) -> DistributedError:
    rank = dist.get_rank() if dist.is_initialized() else -1
    return DistributedError(
        f"rank {rank}: {op} failed ({_first_line(exc)}); a peer rank died, hung or ran a different step"
    )


def all_reduce_(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `x` over the ranks, in place (capturable in a CUDA graph under NCCL)."""
    try:
        dist.all_reduce(x, group=group)
    except (RuntimeError, dist.DistError) as exc:
        raise _failed("all-reduce", exc) from exc
    return x


def all_gather_rows(x: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """x: [B, N] on each rank -> [B, world_size * N], rank r's columns at r*N .. (r+1)*N-1."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    b, n = x.shape
    out = torch.empty((world_size * b, n), dtype=x.dtype, device=x.device)  # ranks stacked on rows
    try:
        gather(out, x.contiguous(), group=group)
    except (RuntimeError, dist.DistError) as exc:
        raise _failed("all-gather", exc) from exc
    return out.view(world_size, b, n).permute(1, 0, 2).reshape(b, world_size * n)


def broadcast_int(value: int, device: torch.device, group=None) -> int:
    """Rank 0's value, on every rank."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    try:
        dist.broadcast(t, src=0, group=group)
    except (RuntimeError, dist.DistError) as exc:
        raise _failed("broadcast", exc) from exc
    return int(t.item())


def min_int(value: int, device: torch.device, group=None) -> int:
    """The smallest of the ranks' values, on every rank."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    except (RuntimeError, dist.DistError) as exc:
        raise _failed("all-reduce (min)", exc) from exc
    return int(t.item())


class ParentWatchdog:
    """A daemon thread that ends this process when the process that spawned it is gone.

    Without it, a rank whose launcher was killed would wait on its command queue (or in a
    collective) forever. Checks every `interval_s`; exits with EXIT_PARENT_GONE.
    """

    def __init__(self, interval_s: float = 1.0):
        self.parent = os.getppid()
        self.interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="sparsegen-parent-watchdog", daemon=True)

    def start(self) -> ParentWatchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            if os.getppid() != self.parent:
                log.error(
                    "tensor-parallel rank %s: the launching process %d is gone; exiting",
                    os.environ.get("RANK", "?"),
                    self.parent,
                )
                sys.stderr.flush()
                os._exit(EXIT_PARENT_GONE)
