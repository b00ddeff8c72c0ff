"""One model on one device: the model runner and what it owns.

`model_runner.ModelRunner` runs a step's `request.sequence.Plan` through the model and samples
it; around it sit the paged KV cache (`kv_cache`), the captured decode graphs (`cuda_graphs`,
`graph_capture`) and their inputs (`decode_inputs`), the sampler (`sampling`), the step in
flight (`inflight`), the host-to-device copies (`transfer`), and the engine's sizing
(`config.EngineConfig`).

The layering, bottom to top: `request` < `runner` < `parallel` < `engine`. A runner knows
nothing of ranks: `parallel` runs one per rank over its shard, `engine` picks the executor and
schedules. Nothing here imports `parallel` or `engine`. Nothing is imported here, so that
importing one module of the package imports no other.
"""
