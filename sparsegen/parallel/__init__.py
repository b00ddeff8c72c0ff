"""Tensor parallelism below the model runner: rank processes, their failures, and the weight shards.

`LLMEngine(..., tensor_parallel_size=N)` runs its model through `executor` (the driver side),
whose ranks (`rank`) each run a `ModelRunner` over their shard (`sharding`, `loader`) of the
weights that a `source.ModelSource` names; `distributed` holds the process groups and the
collectives, `failures` what crosses the process boundary when a rank fails.

Nothing is imported here, so that importing one module of the package imports no other.
"""
