"""Every compiled kernel, under one lifecycle (`base`): attention (prefill tl + Gluon, paged
decode), `linear` (the batch-1 GEMV, the few-row GEMM) and `fused` (rotary + KV write, GeGeLU,
add + LayerNorm); each family renders, builds, caches and launches its own kernels."""
