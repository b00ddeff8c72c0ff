"""Linear layers of the model as compiled kernels: the batch-1 Triton GEMV and the few-row CUDA GEMM."""
