"""The model's fused elementwise Triton kernels: rotary + K/V cache write, GeGeLU, add + LayerNorm."""
