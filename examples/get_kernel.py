"""Fetch the compiled prefill kernel for Phi-3-Small's sparse layer and run it.

    python examples/get_kernel.py            # on an sm_80+ GPU
    TRITON_INTERPRET=1 python examples/get_kernel.py   # on a CPU, in Triton's interpreter

The first call compiles and caches the kernel (SPARSEGEN_CACHE_DIR); later calls and later
processes load it from the cache.
"""

import os
import sys

import torch

import sparsegen
from sparsegen.testing import rel_err

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("no GPU here: run with TRITON_INTERPRET=1 to use Triton's interpreter on the CPU")

layer = sparsegen.get_pattern("phi3small").layers[0]  # 32 heads, 8 KV heads, head_dim 128
on_gpu = torch.cuda.is_available()
device, dtype, seq = ("cuda", torch.bfloat16, 4096) if on_gpu else ("cpu", torch.float16, 160)

found = sparsegen.lookup_kernel(layer, "prefill", dtype=dtype)  # the kernel, and how it was found
kernel = found.kernel
print(f"{kernel.name}\n  key  {kernel.key}\n  path {kernel.path}\n  {found.status} in {found.seconds:.2f} s")
print("\n".join(kernel.source.splitlines()[:12]), "\n  ...")

q = torch.randn(seq, 32, 128, device=device, dtype=dtype)  # q: [T, H, D]
k = torch.randn(seq, 8, 128, device=device, dtype=dtype)  # k: [T, Hkv, D]
v = torch.randn(seq, 8, 128, device=device, dtype=dtype)
cu = torch.tensor([0, seq], dtype=torch.int32, device=device)
out = kernel(q, k, v, cu, cu)  # [T, H, D]
ref = sparsegen.reference.prefill(q.float(), k.float(), v.float(), cu, cu, layer)
print(f"rel err vs the reference: {rel_err(out, ref):.2e}")
