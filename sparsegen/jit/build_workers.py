"""Triton builds in worker processes, for commands that build many kernels at once.

Triton's front end (the kernel's AST to MLIR, and most passes) holds the GIL, so Triton builds
in threads of one process run one after another: on the H200 host the cold `sparsegen compile
--pattern phi3small` spent 5.4 s on its two Gluon kernels in threads, about their sum. Here each
build goes to a worker process (`python -c`, importing Triton but not torch, which takes ~5 s
to import on that host), so builds run side by side. NVRTC releases the GIL and needs no workers.

    keys = build_workers.map_in_threads(build_one, jobs, triton_builds=len(jobs))
    # build_one(job) runs in a thread; the triton_build.aot_compile calls it makes compile in
    # the workers (`using(...)` sets them for a context, copied into each thread)

A worker reads one job per line on stdin and writes one reply per line on stdout (JSON; the
built files base64-encoded). Its result is what `triton_compile.compile_in_process` returns in the
parent: the same function runs there. A worker that dies is reported as a CompileError naming
its exit status and the end of its stderr; a worker is never reused after a failed exchange.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import contextvars
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ..errors import CompileError
from ..log import get_logger
from .triton_compile import compile_in_process

log = get_logger(__name__)
T, R = TypeVar("T"), TypeVar("R")

_CURRENT: contextvars.ContextVar[BuildWorkers | None] = contextvars.ContextVar("build_workers", default=None)
WORKER_CODE = "from sparsegen.jit.build_workers import serve; serve()"


def current() -> BuildWorkers | None:
    """The workers builds in this context should use, or None (build in this process)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(workers: BuildWorkers) -> Iterator[BuildWorkers]:
    token = _CURRENT.set(workers)
    try:
        yield workers
    finally:
        _CURRENT.reset(token)


def worker_env() -> dict[str, str]:
    """The environment of a worker: this process's, with the folder this sparsegen was imported
    from first on PYTHONPATH, so the worker runs the same code whatever the working directory."""
    root = str(Path(__file__).resolve().parents[2])  # .../<root>/sparsegen/jit/build_workers.py
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root + (os.pathsep + rest if rest else "")}


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)  # its last lines
        # Drain stderr as it comes, so a chatty build cannot block the worker on a full pipe.
        self._drainer = threading.Thread(target=self._stderr.extend, args=(self.proc.stderr,), daemon=True)
        self._drainer.start()

    def run(self, job: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self.proc.wait()
            self._drainer.join(timeout=5)  # the last lines it wrote before exiting
            tail = "".join(self._stderr).strip()[-1500:]
            raise CompileError(f"a Triton build worker exited with status {code}: {tail or 'no stderr'}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class BuildWorkers:
    """Up to `n` worker processes, started on first use (`start()` starts them all now, so their
    start-up overlaps the caller's own work); `compile(job)` blocks the calling thread only."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"BuildWorkers needs n >= 1, got {n}")
        self.n = n
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def start(self) -> BuildWorkers:
        with self._lock:
            while len(self._all) < self.n:
                try:
                    worker = _Worker()
                except OSError as exc:  # compile() builds in this process instead
                    log.warning("cannot start a Triton build worker (%s); builds run in this process", exc)
                    break
                self._all.append(worker)
                self._idle.put(worker)
        return self

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle.empty() and len(self._all) < self.n:
                worker = _Worker()
                self._all.append(worker)
                return worker
        return self._idle.get()

    def compile(self, job: dict) -> dict[str, bytes]:
        """Run `triton_compile.compile_in_process(job)` in a worker; its files by name. If no worker
        process can be started at all, the build runs in this process (the same function)."""
        try:
            worker = self._take()
        except OSError as exc:
            log.warning("cannot start a Triton build worker (%s); building in this process", exc)
            return compile_in_process(job)
        try:
            reply = worker.run(job)
        except BaseException:
            worker.close()
            with self._lock:
                self._all.remove(worker)
            raise
        self._idle.put(worker)
        if "error" in reply:
            raise CompileError(reply["error"])
        return {name: base64.b64decode(data) for name, data in reply["files"].items()}

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.close()

    def __enter__(self) -> BuildWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def map_in_threads(fn: Callable[[T], R], items: list[T], *, triton_builds: int) -> list[R]:
    """[fn(item) for item in items], a thread per item (up to the CPU count), in order; with
    `triton_builds` > 1, the Triton builds those calls make go to that many worker processes
    (started now, so their start-up overlaps the rest). The kernel lifecycle itself (render,
    cache, load) runs in the threads of this process, as for one kernel."""
    threads = max(1, min(len(items), os.cpu_count() or 1))
    with contextlib.ExitStack() as stack:
        if triton_builds > 1:
            workers = stack.enter_context(BuildWorkers(min(triton_builds, threads)))
            stack.enter_context(using(workers.start()))
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=threads))
        ctx = contextvars.copy_context()  # each thread builds with this context's workers
        return list(pool.map(lambda item: ctx.copy().run(fn, item), items))


def serve() -> None:
    """The worker's loop: one JSON job per stdin line, one JSON reply per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a build prints must not corrupt the reply stream
    for line in sys.stdin:
        try:
            files = compile_in_process(json.loads(line))
            reply = {"files": {n: base64.b64encode(b).decode("ascii") for n, b in files.items()}}
        except CompileError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a CompileError
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
