"""`sparsegen serve` as a process: SIGTERM drains the request in flight and exits 0 (with `--tp 2`
on the CPU too: then the two gloo ranks exit with it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import extras
from helpers.tp import children, exited

httpx = extras.require("httpx")
extras.require("fastapi")

pytestmark = pytest.mark.slow  # each test starts a server process
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tp", ["1", "2"])
def test_sigterm_drains_and_exits_zero(tp):
    if tp != "1" and not os.path.isdir("/proc"):
        pytest.skip("finds the rank processes in /proc")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", "from sparsegen.cli import main; main()", "serve", "--random", "tiny", "--port", "0", "--no-warmup",
           "--drain-timeout", "30", "--device", "cpu", "--tp", tp]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    port = []
    started = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not started.wait(0.1):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        url = f"http://127.0.0.1:{port[0]}"
        deadline = time.monotonic() + 30
        while True:  # the log line comes just before uvicorn listens
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {
            "model": "random-tiny",
            "prompt": "drain me",
            "max_tokens": 60,
            "stream": True,
            "ignore_eos": True,
        }
        ranks = children(proc.pid) if tp != "1" else []
        if tp != "1":
            assert len(ranks) >= int(tp), ranks  # the ranks (and multiprocessing's resource tracker)
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                chunks.append(line)
                if len(chunks) == 4:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
        data = [c for c in chunks if c.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in data[-2]  # the request ran to its end
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(10)
        log = "".join(lines)
        assert re.search(
            r"request cmpl-0-[0-9a-f]+: 8 prompt \+ 60 completion tokens, ttft [\d.]+ s, latency [\d.]+ s",
            log,
        ), log
        assert "Traceback" not in log, log
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=5)
        deadline = time.monotonic() + 15
        while not all(exited(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(exited(p) for p in ranks), "ranks outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
