"""This checkout against another one on the GPU, the same cases interleaved, ratios printed.

    git -C /path/to/repo worktree add /tmp/sg-base <commit-before>     # or any checkout
    PYTHONPATH=$PWD python benchmarks/tools/compare_commits.py --base /tmp/sg-base [--rounds 3]

Cases (bf16, batch 1 prefill, 32 q heads / 8 KV heads / d 128): phi3small prefill 8K, 32K,
128K and sliding-window-4096 prefill 32K (the public `sparsegen.prefill`, and the kernel alone
with check=False), then paged decode 64x8K, 8x32K, 1x128K (page 16, CUDA-graph replays).

Why subprocesses and not one process: both trees are the package `sparsegen` and both register
the custom ops `sparsegen::prefill` / `sparsegen::paged_decode`, which torch.library refuses to
register twice in one process. So each round runs one worker per tree, alternating which tree
goes first, on the same GPU with the same seeded inputs; every worker warms up (compiles or
loads its kernels, cache per tree) before timing. The ratio per case is the median over rounds
of new/base; < 1.00 means this checkout is faster. Issue 9's bar: every ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]

WORKER = r"""
import json, sys, torch, sparsegen
try:
    from sparsegen.commands.bench.common import median_ms, median_ms_graph
except ImportError:  # a checkout that keeps the timing helpers in sparsegen/bench/
    from sparsegen.bench.common import median_ms, median_ms_graph
out = {}
bf16 = torch.bfloat16
def layer_of(name):
    model = sparsegen.get_pattern(name)
    return next(l for l in model.layers if not l.is_dense)
import os
PREFILL = (("phi3small", 8192), ("phi3small", 32768), ("phi3small", 131072), ("sliding-window", 32768))
for name, seq in () if os.environ.get("COMPARE_DECODE_ONLY") else PREFILL:
    layer = layer_of(name)
    g = torch.Generator(device="cuda").manual_seed(seq)
    q = torch.randn(seq, 32, 128, device="cuda", dtype=bf16, generator=g)
    k = torch.randn(seq, 8, 128, device="cuda", dtype=bf16, generator=g)
    v = torch.randn(seq, 8, 128, device="cuda", dtype=bf16, generator=g)
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    kernel = sparsegen.get_kernel(layer, "prefill", dtype=bf16)
    kernel(q, k, v, cu, cu)
    sparsegen.prefill(q, k, v, cu, cu, layer, impl="triton")
    tag = f"prefill {name} {seq // 1024}K"
    out[tag + " api_ms"] = median_ms(lambda: sparsegen.prefill(q, k, v, cu, cu, layer, impl="triton"))
    out[tag + " kernel_ms"] = median_ms(lambda: kernel(q, k, v, cu, cu, check=False))
    try:  # max_seqlen_q/k (no host read of cu_seqlens) exist from session 3 on
        sparsegen.prefill(q, k, v, cu, cu, layer, impl="triton", max_seqlen_q=seq, max_seqlen_k=seq)
    except TypeError:
        pass
    else:
        out[tag + " api_max_seqlen_ms"] = median_ms(
            lambda: sparsegen.prefill(q, k, v, cu, cu, layer, impl="triton", max_seqlen_q=seq, max_seqlen_k=seq)
        )
    out[tag + " variant"] = getattr(kernel.request, "variant", "tl") if hasattr(kernel, "request") else "tl"
    del q, k, v
layer = layer_of("phi3small")
for batch, seq in ((64, 8192), (8, 32768), (1, 131072)):
    g = torch.Generator(device="cuda").manual_seed(batch * seq)
    pages = -(-seq // 16)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=bf16, generator=g)
    kc = torch.randn(batch * pages, 16, 8, 128, device="cuda", dtype=bf16, generator=g)
    vc = torch.randn(batch * pages, 16, 8, 128, device="cuda", dtype=bf16, generator=g)
    bt = torch.randperm(batch * pages, device="cuda", generator=g).to(torch.int32).view(batch, pages)
    sl = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    run = lambda: sparsegen.paged_decode(q, kc, vc, bt, sl, layer, impl="cuda")
    run()
    ms, captured = median_ms_graph(run)
    out[f"decode {batch}x{seq // 1024}K graph_us"] = ms * 1e3
    assert captured, "decode did not capture in a CUDA graph"
    del q, kc, vc
print("RESULT " + json.dumps(out))
"""


def run_worker(tree: Path, cache: Path, *, tl: bool = False, decode_only: bool = False) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "SPARSEGEN_CACHE_DIR": str(cache), "SPARSEGEN_QUIET": "1"}
    if decode_only:
        env["COMPARE_DECODE_ONLY"] = "1"
    if tl:  # both trees on the tl prefill kernel (older trees have no other and ignore the flag)
        env["SPARSEGEN_PREFILL_TL"] = "1"
    proc = subprocess.run([sys.executable, "-c", WORKER], env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker for {tree} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description="time this checkout against --base, interleaved")
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (e.g. the commit before)")
    ap.add_argument(
        "--new", default=HERE, type=Path, help="this checkout (default: the one holding this script)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tl", action="store_true", help="force the tl prefill kernel in both trees")
    ap.add_argument("--decode-only", action="store_true", help="only the decode cases (fresh processes)")
    ap.add_argument("--out", type=Path, default=None, help="write every round's numbers as JSON")
    args = ap.parse_args()
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="sg-compare-") as tmp:
        caches = {name: Path(tmp) / name for name in trees}
        for c in caches.values():
            c.mkdir(mode=0o700)
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            result = {
                name: run_worker(trees[name], caches[name], tl=args.tl, decode_only=args.decode_only)
                for name in order
            }
            rounds.append(result)
            print(f"round {r + 1}/{args.rounds} done (order {order[0]} first)", file=sys.stderr, flush=True)
    for name in trees:
        variants = {c: v for c, v in rounds[0][name].items() if c.endswith(" variant")}
        print(f"{name}: prefill variants {sorted(set(variants.values()))}")
    cases = [c for c, v in rounds[0]["base"].items() if not isinstance(v, str)]
    extra = [c for c, v in rounds[0]["new"].items() if c not in rounds[0]["base"] and not isinstance(v, str)]
    print(f"{'case':40s} {'base':>10s} {'new':>10s} {'new/base':>9s}")
    worst = 0.0
    for case in cases:
        base = statistics.median(r["base"][case] for r in rounds)
        new = statistics.median(r["new"][case] for r in rounds)
        ratio = statistics.median(r["new"][case] / r["base"][case] for r in rounds)
        worst = max(worst, ratio)
        flag = "" if ratio <= 1.02 else "  <-- slower than 2 %"
        print(f"{case:40s} {base:10.4g} {new:10.4g} {ratio:9.3f}{flag}")
    for case in extra:  # cases only this checkout has (e.g. the API with max_seqlen)
        print(f"{case:40s} {'-':>10s} {statistics.median(r['new'][case] for r in rounds):10.4g}")
    print(f"worst ratio {worst:.3f} ({'within' if worst <= 1.02 else 'OUTSIDE'} the 2 % bar)")
    if args.out:
        args.out.write_text(
            json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "rounds": rounds}, indent=1)
        )


if __name__ == "__main__":
    main()
