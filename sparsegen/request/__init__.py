"""What a generation request is, shared by every layer that handles one: `SamplingParams`
(`sampling_params`, checked when made, with the types a sampler returns) and `Sequence`, with
the `Chunk` of it and the `Plan` of one step that the scheduler hands the model runner
(`sequence`).

This package sits below `runner`, `parallel`, `engine`, `llm` and `serve`, and imports none of
them. Nothing is imported here, so that importing one module of the package imports no other.
"""
