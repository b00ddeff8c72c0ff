"""What runs the model under `LLMEngine`: an `Executor`.

The engine (scheduler, page allocator, sampling parameters, results) never knows how many
processes run the model. It hands each step's `Plan` to `Executor.launch`, which runs the forward
pass and the sampler and returns the step `InFlight`; the engine reads its tokens later.

- `ModelRunner` (runner.model_runner) runs the model in this process: `launch` is a direct
  method call, with no queue and no copy.
- `parallel.executor.MultiprocExecutor` runs it in `tensor_parallel_size` rank processes, each a
  ModelRunner over its shard and its own KV cache (the same number of pages on every rank): it
  sends every rank each step's plan and reads rank 0's tokens.

`open_executor` picks one: a model object runs here; a `parallel.source.ModelSource` is built
here (`tensor_parallel_size=1`) or in the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..errors import InputError
from ..models.config import Phi3SmallConfig
from ..models.families import DecoderConfig, DecoderForCausalLM
from ..models.phi3small import Phi3SmallForCausalLM
from ..parallel.source import ModelSource
from ..request.sequence import Plan
from ..runner.config import EngineConfig
from ..runner.inflight import InFlight
from ..runner.kv_cache import CachePages
from ..runner.model_runner import ModelRunner


class Executor(Protocol):
    """Runs steps of one model for one engine."""

    cache: CachePages  # the pages the engine's scheduler hands out (a KVCache in this process)

    def launch(self, plan: Plan, after: InFlight | None, eos_token_id: int | None) -> InFlight:
        """Run `plan` (forward pass, then the sampler for `plan.sampled`) without waiting for its
        tokens; `after` is the step in flight whose tokens a lookahead plan takes as input."""
        ...

    def close(self, kill: bool = False) -> None:
        """Release what it holds (rank processes); `kill` stops them without waiting."""
        ...


@dataclass(frozen=True)
class ModelFacts:
    """What the engine checks its arguments against before any weight is read or rank started."""

    config: Phi3SmallConfig | DecoderConfig
    device: torch.device
    attn_impl: str | None


def model_facts(model: object, config: EngineConfig, device) -> ModelFacts:
    """The model's config and where it runs; for a ModelSource, `tensor_parallel_size` checked
    against the model (whole KV groups and GeGeLU units per rank) and the visible GPUs."""
    if isinstance(model, (Phi3SmallForCausalLM, DecoderForCausalLM)):
        if config.tensor_parallel_size != 1:
            raise InputError(
                f"tensor_parallel_size={config.tensor_parallel_size} needs a ModelSource (each rank builds "
                "its own shard), not a model built in this process"
            )
        if device is not None and torch.device(device) != model.device:
            raise InputError(f"device={device!r}, but the model is on {model.device}")
        return ModelFacts(model.config, model.device, model.attn_impl)
    if not isinstance(model, ModelSource):
        raise InputError(f"model must be a Phi3SmallForCausalLM or a ModelSource, got {type(model).__name__}")
    dev = _source_device(device)
    cfg = model.load_config()
    if config.tensor_parallel_size != 1:
        # imported here, not at the top: a spawned rank imports parallel.rank first, which
        # imports sparsegen.engine, whose __init__ imports this module; a top-level import of
        # parallel.executor here would then import the half-initialised parallel.rank
        from ..parallel.executor import check_tensor_parallel

        check_tensor_parallel(cfg, config.tensor_parallel_size, dev.type)
    return ModelFacts(cfg, dev, model.attn_impl)


def _source_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"device {device!r} is not a torch device (use 'cuda', 'cuda:N' or 'cpu')") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be cpu or cuda, got {device!r}")
    return dev


def open_executor(model: object, facts: ModelFacts, config: EngineConfig, max_model_len: int) -> Executor:
    """The executor for `model` (checked by `model_facts`): this process's ModelRunner, or the
    ranks' driver when `config.tensor_parallel_size` > 1."""
    if isinstance(model, ModelSource):
        if config.dense_attention:
            model = replace(model, force_dense=True)
        if config.tensor_parallel_size == 1:
            model = model.build_model(facts.device)
        else:
            from ..parallel.executor import MultiprocExecutor

            return MultiprocExecutor(
                model, config, max_model_len=max_model_len, device_type=facts.device.type
            )
    return ModelRunner(model, config, max_model_len=max_model_len)
