"""Cold AOT build time of one 32-head layer against its number of distinct head patterns.

    PYTHONPATH=$PWD python benchmarks/jit/compile_sweep.py [--arch sm_90] [--kinds prefill,decode] [--n 1,2,4,8,16,32]

Heads get N distinct (local_blocks, vert_stride, vert_offset) patterns of block size 64, GQA
32/8, head_dim 128, bf16 (as in issue 9's table). Each build runs in a fresh subprocess with an
empty cache (sparsegen's and Triton's own), so nothing is warm; the time is the whole get_kernel call (render + compile + store):
wall seconds, and CPU seconds of the process and its children (the honest number on a shared
machine, where wall time mostly measures the other jobs).
No GPU is needed: kernels are compiled ahead of time for --arch. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time
import torch, sparsegen
from sparsegen import HeadSpec, LayerSpec
n, kind, arch = int(sys.argv[1]), sys.argv[2], sys.argv[3]
patterns = [(1 + (i * 5) % 16, 2 + i % 7, 0) for i in range(n)]  # N distinct (local, stride, offset)
heads = []
for h in range(32):
    local, stride, _ = patterns[h % n]
    heads.append(HeadSpec(block_size=64, local_blocks=local, vert_stride=stride, vert_offset=h % stride))
layer = LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128, heads=tuple(heads))
assert len({(h.local_blocks, h.vert_stride) for h in layer.heads}) == n
extra = {"page_size": 16} if kind == "decode" else {}
def cpu():  # this process and its children (ptxas): robust when other jobs share the cores
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
c0, t0 = cpu(), time.perf_counter()
found = sparsegen.lookup_kernel(layer, kind, dtype=torch.bfloat16, arch=arch, **extra)
print(json.dumps({"n": n, "kind": kind, "seconds": time.perf_counter() - t0, "cpu_seconds": cpu() - c0,
                  "status": found.status, "name": found.kernel.name}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kinds", default="prefill,decode")
    ap.add_argument("--n", default="1,2,4,8,16,32")
    args = ap.parse_args()
    rows = []
    for kind in args.kinds.split(","):
        for n in map(int, args.n.split(",")):
            with tempfile.TemporaryDirectory(prefix="sg-sweep-") as cache:
                os.chmod(cache, 0o700)
                env = {**os.environ, "SPARSEGEN_CACHE_DIR": cache, "SPARSEGEN_QUIET": "1",
                       "TRITON_CACHE_DIR": os.path.join(cache, "triton")}  # Triton's own cache, cold too  # fmt: skip
                env.pop("TRITON_INTERPRET", None)
                out = subprocess.run([sys.executable, "-c", CHILD, str(n), kind, args.arch], env=env,
                                     capture_output=True, text=True, check=True)  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            assert row["status"] == "compiled", row
            rows.append(row)
            print(f"{kind:8s} N={n:2d}  wall {row['seconds']:6.2f} s  cpu {row['cpu_seconds']:6.2f} s  {row['name']}",
                  flush=True)  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
