"""Load test of `sparsegen serve`: throughput, TTFT and inter-token latency at several concurrencies.

One command starts the server (random weights by default), waits for /health, runs a bounded
number of streaming /v1/completions requests at each concurrency, prints a table and one JSON
line per level, then sends SIGTERM and checks that the server exited 0:

    PYTHONPATH=$PWD python benchmarks/serve/bench_serve.py --random 7b --concurrency 1,8,32,64

Each request sends `--prompt-len` random token ids and streams `--max-tokens` new tokens
(greedy, `ignore_eos`, so every request makes exactly that many). Before each level, one
unmeasured wave of short requests at the same concurrency captures the CUDA graphs of that
batch size. Latencies are measured on the client: TTFT from sending the request to the first
token's chunk; inter-token latency (ITL) between successive token chunks (a chunk holding k
tokens counts as k gaps of 1/k of the time); throughput is generated tokens over the level's
wall time. `--url` measures a server that is already running instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(args) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-c", "from sparsegen.cli import main; main()", "serve", "--port", "0"]
    cmd += ["--model", args.model] if args.model else ["--random", args.random]
    cmd += ["--max-num-seqs", str(max(args.levels)), "--max-queue", str(4 * max(args.levels))]
    cmd += ["--max-model-len", str(args.max_model_len), *args.server_arg]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()
    url = []

    def pump():
        for line in proc.stderr:
            lines.append(line)
            if args.verbose:
                sys.stderr.write("[server] " + line)
            m = re.search(r"serving \S+ on (http://\S+?:\d+)", line)
            if m and not url:
                url.append(m.group(1))
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + args.start_timeout
    while not found.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not start:\n" + "".join(lines[-30:]))
    return proc, url[0], lines


async def wait_healthy(client, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get(url + "/health")).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout} s")


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    first, last, tokens, gaps = None, None, 0, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            k = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
            if not k:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps += [(now - last) / k] * k
            tokens += k
            last = now
    return {"ttft": (first or t0) - t0, "latency": time.perf_counter() - t0, "tokens": tokens, "itl": gaps}


async def run_level(client, url, model, c: int, n: int, args, rng) -> dict:
    sem = asyncio.Semaphore(c)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(n)]

    async def bounded(prompt, max_tokens):
        async with sem:
            return await one_request(client, url, model, prompt, max_tokens)

    await asyncio.gather(*(bounded(p, 4) for p in prompts[:c]))  # warm-up wave: graphs of this batch size
    t0 = time.perf_counter()
    results = await asyncio.gather(*(bounded(p, args.max_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    lat = [r["latency"] for r in ok]
    return {
        "concurrency": c,
        "requests": n,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "latency_p50_s": percentile(lat, 50),
    }


async def bench(args, url: str) -> list[dict]:
    import httpx

    limits = httpx.Limits(
        max_connections=max(args.levels) + 8, max_keepalive_connections=max(args.levels) + 8
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        await wait_healthy(client, url, args.start_timeout)
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        rows = []
        for c in args.levels:
            n = args.requests if args.requests else min(max(4, 2 * c), 128)
            row = await run_level(client, url, model, c, n, args, rng)
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--random", default="7b", help="random weights of this size (default 7b)")
    src.add_argument("--model", help="a checkpoint folder instead of random weights")
    p.add_argument("--url", help="measure a running server at this URL (nothing is started)")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 x level, 4..128)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `sparsegen serve` argument (repeatable)"
    )
    p.add_argument("--json", dest="json_out", help="also write the rows to this file")
    p.add_argument("--verbose", action="store_true", help="echo the server's log")
    args = p.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",") if x]
    t_start = time.perf_counter()
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        proc, url, lines = start_server(args)
    try:
        rows = asyncio.run(bench(args, url))
    finally:
        code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed after 60 s"
    print(f"\n{'conc':>5} {'reqs':>5} {'err':>4} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}   (ms)")  # fmt: skip
    for r in rows:
        print(
            f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} {r['throughput_tok_s']:>9.1f} "
            f"{r['requests_per_s']:>7.2f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
            f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f}"
        )
    total = time.perf_counter() - t_start
    print(
        f"-- prompt {args.prompt_len} tokens, {args.max_tokens} new tokens per request; total {total:.1f} s"
    )
    if proc is not None:
        print(f"-- server exit status after SIGTERM: {code}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "server_exit": code, "total_s": total}, f, indent=2)
    failed = any(r["errors"] for r in rows) or (proc is not None and code != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
