"""Where one `engine.generate` call's wall time goes, for `profile_prefill.py --host`.

Nothing here edits the engine: `instrumented(engine, timeline)` wraps methods of the engine's own
instances (and hooks the model) for the length of a `with` block, and puts them back after.

- `Timeline` takes `time.perf_counter()` at each stage boundary and, on a GPU, records a CUDA
  event on the current stream at the same moment, so that each stage shows its host time and
  the time the GPU reached that point of the stream (both from the first mark).
- `ClockSampler` polls the GPU's SM clock and power draw (read-only: NVML if `pynvml` imports,
  else `nvidia-smi --query-gpu=... -lms`) in the background.
- `top_functions` turns a cProfile run into rows (by tottime or cumtime).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pstats
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mark:
    stage: str
    host_s: float  # time.perf_counter()
    event: torch.cuda.Event | None  # recorded on the current stream at host_s (GPU only)


class Timeline:
    """Stage marks of one call: host time from `perf_counter`, GPU time from CUDA events."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[Mark] = []

    def mark(self, stage: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append(Mark(stage, time.perf_counter(), event))

    def rows(self) -> list[dict]:
        """One dict per mark: host_ms and gpu_ms from the first mark, and the deltas from the mark
        before (gpu_* are None on a CPU). Synchronises first, so every event has completed."""
        if not self.marks:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        first = self.marks[0]
        out, prev = [], None
        for m in self.marks:
            host = (m.host_s - first.host_s) * 1e3
            gpu = first.event.elapsed_time(m.event) if m.event is not None else None
            out.append({
                "stage": m.stage,
                "host_ms": host,
                "host_delta_ms": host - prev["host_ms"] if prev else 0.0,
                "gpu_ms": gpu,
                "gpu_delta_ms": gpu - prev["gpu_ms"] if prev and gpu is not None else (0.0 if gpu is not None else None),
            })  # fmt: skip
            prev = out[-1]
        return out


def _after(obj, name: str, tl: Timeline, stage: str, before: str | None = None) -> Callable[[], None]:
    """Shadow the bound method `obj.name` with one that marks `before` (if given) on entry and
    `stage` on return; returns the undo."""
    inner = getattr(obj, name)

    def wrapped(*args, **kwargs):
        if before is not None:
            tl.mark(before)
        result = inner(*args, **kwargs)
        tl.mark(stage)
        return result

    setattr(obj, name, wrapped)
    return lambda: delattr(obj, name) if name in vars(obj) else None


@contextlib.contextmanager
def instrumented(engine, tl: Timeline) -> Iterator[None]:
    """Marks at the stage boundaries of `engine`'s calls while the block runs (see `STAGES`)."""
    undo = [
        _after(engine, "submit", tl, "submitted (prompt checked, queued)"),
        _after(engine.scheduler, "schedule", tl, "scheduled (plan made)"),
        _after(engine.runner, "prepare_prefill", tl, "batch built (H2D copies queued)"),
        _after(engine.runner, "run", tl, "forward launched (host returned)"),
        _after(engine, "_launch", tl, "sampler launched (D2H queued)"),
        _after(engine.scheduler, "postprocess", tl, "booked", before="token on host (or chunk done)"),
    ]
    model = engine.runner.model
    if isinstance(model, torch.nn.Module):
        hook = model.register_forward_pre_hook(lambda *_: tl.mark("forward start (first kernel next)"))
        undo.append(hook.remove)
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def summary(rows: list[dict]) -> dict:
    """The few spans that answer "where does TTFT go" (ms; None where a mark is missing). Marks
    are named by their stage's first words. A prompt longer than one chunk runs one forward per
    chunk: `gpu_forwards_ms` goes from the first forward's start to the last one's end, and the
    sampler and token spans are the last chunk's."""
    first: dict[str, dict] = {}
    last: dict[str, dict] = {}
    for r in rows:
        name = r["stage"].split(" (")[0]
        first.setdefault(name, r)
        last[name] = r

    def span(a: dict, b: dict, key: str) -> float | None:
        if a is None or b is None or a[key] is None or b[key] is None:
            return None
        return b[key] - a[key]

    f, lt = first.get, last.get
    return {
        "forwards": sum(r["stage"].startswith("forward launched") for r in rows),
        "host_before_first_forward_ms": span(f("start"), f("forward start"), "host_ms"),
        "host_first_forward_launch_ms": span(f("forward start"), f("forward launched"), "host_ms"),
        "gpu_idle_before_first_forward_ms": span(f("start"), f("forward start"), "gpu_ms"),
        "gpu_forwards_ms": span(f("forward start"), lt("forward launched"), "gpu_ms"),
        "gpu_sampler_ms": span(lt("forward launched"), lt("sampler launched"), "gpu_ms"),
        "host_wait_for_token_ms": span(lt("sampler launched"), lt("token on host"), "host_ms"),
        "host_after_token_ms": span(lt("token on host"), lt("returned"), "host_ms"),
        "total_host_ms": span(f("start"), lt("returned"), "host_ms"),
    }


def print_rows(rows: list[dict]) -> None:
    print(f"  {'stage':44s} {'host ms':>9s} {'+host':>8s} {'GPU ms':>9s} {'+GPU':>8s}")
    for r in rows:
        gpu = "" if r["gpu_ms"] is None else f"{r['gpu_ms']:9.2f} {r['gpu_delta_ms']:8.2f}"
        print(f"  {r['stage']:44s} {r['host_ms']:9.2f} {r['host_delta_ms']:8.2f} {gpu}")


class GcPauses:
    """Python's garbage collections while the block runs: count and milliseconds per generation
    (a collection of the oldest generation in a process holding torch can take milliseconds)."""

    def __init__(self):
        self.ms = {0: 0.0, 1: 0.0, 2: 0.0}
        self.count = {0: 0, 1: 0, 2: 0}
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.count[g] += 1
            self.ms[g] += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> dict:
        return {f"gen{g}": {"collections": self.count[g], "ms": self.ms[g]} for g in self.ms}


def top_functions(prof, sort: str, limit: int = 25) -> list[dict]:
    """cProfile rows sorted by "tottime" or "cumtime": function, calls, tottime_ms, cumtime_ms."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    key = {"tottime": 2, "cumtime": 3}[sort]
    top = sorted(stats.items(), key=lambda kv: kv[1][key], reverse=True)[:limit]
    out = []
    for (path, line, name), (_cc, nc, tt, ct, _callers) in top:
        where = f"{os.path.basename(path)}:{line}" if path != "~" else "~"
        out.append(
            {"function": f"{where}({name})", "calls": nc, "tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3}
        )
    return out


def print_functions(rows: list[dict], title: str) -> None:
    print(f"  {title}")
    print(f"  {'tottime ms':>10s} {'cumtime ms':>10s} {'calls':>8s}  function")
    for r in rows:
        print(f"  {r['tottime_ms']:10.3f} {r['cumtime_ms']:10.3f} {r['calls']:8d}  {r['function'][:90]}")


class ClockSampler:
    """Background samples of (perf_counter, SM clock MHz, power W) of GPU `index`, every
    `period_s`; read-only queries. `source` says what answered (None: nothing could)."""

    def __init__(self, index: int = 0, period_s: float = 0.02):
        self.index, self.period_s = index, period_s
        self.samples: list[tuple[float, float, float]] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
            self.source = "nvml"
        except Exception:  # noqa: BLE001 - no NVML bindings: fall back to nvidia-smi
            if shutil.which("nvidia-smi"):
                self.source = "nvidia-smi"

    def _poll_nvml(self) -> None:
        nvml, handle = self._nvml
        while not self._stop.is_set():
            clock = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
            power = nvml.nvmlDeviceGetPowerUsage(handle) / 1e3
            self.samples.append((time.perf_counter(), float(clock), power))
            time.sleep(self.period_s)

    def _read_smi(self) -> None:
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.perf_counter(), float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue

    def __enter__(self) -> ClockSampler:
        self._stop.clear()
        self._thread = self._proc = None
        if self.source == "nvml":
            self._thread = threading.Thread(target=self._poll_nvml, daemon=True)
        elif self.source == "nvidia-smi":
            cmd = ["nvidia-smi", "-i", str(self.index), "--query-gpu=clocks.sm,power.draw",
                   "--format=csv,noheader,nounits", "-lms", str(max(1, int(self.period_s * 1e3)))]  # fmt: skip
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read_smi, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def table(self, t0: float, t1: float) -> list[dict]:
        """Samples as dicts with t_ms relative to `t0`, and where each lies: before / during / after
        the call that ran from t0 to t1."""
        out = []
        for t, clock, power in self.samples:
            phase = "before" if t < t0 else ("during" if t <= t1 else "after")
            out.append({"t_ms": (t - t0) * 1e3, "sm_mhz": clock, "power_w": power, "phase": phase})
        return out


def gpu_index() -> int:
    """The NVML/nvidia-smi index of the current CUDA device, as far as CUDA_VISIBLE_DEVICES tells."""
    dev = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if dev < len(ids) and ids[dev].isdigit():
        return int(ids[dev])
    return dev
