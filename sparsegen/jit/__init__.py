"""Just-in-time compilation: cache keys, the on-disk cache, and the compilers."""
