"""GPU benchmarks behind `sparsegen bench`: kernels against baselines and measured ceilings."""
