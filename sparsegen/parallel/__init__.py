"""Tensor parallelism between the model runner and the engine: rank processes, their failures,
and the weight shards.

`LLMEngine(..., tensor_parallel_size=N)` runs its model through `executor` (the driver side),
whose ranks (`rank`) each run a `ModelRunner` over their shard (`sharding`, `loader`) of the
weights that a `source.ModelSource` names; `distributed` holds the process groups and the
collectives, `failures` what crosses the process boundary when a rank fails.

The package sits above `runner` (what each rank runs) and `request` (the plans it carries), and
below `engine`, whose `engine.executor` picks `executor.MultiprocExecutor` when
`tensor_parallel_size > 1`: nothing here imports `engine`.

Nothing is imported here, so that importing one module of the package imports no other.
"""
