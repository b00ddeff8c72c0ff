"""`ModelSource`: where a model's weights come from, as plain data that any process can build from.

`LLMEngine(ModelSource(...), tensor_parallel_size=N)` sends it to each of N ranks as is (each
builds its shard with `build`); with N = 1 the engine builds the whole model in this process
(`build_model`), exactly as `models.load_checkpoint` / `models.random_model` would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError


@dataclass(frozen=True)
class ModelSource:
    """Where every rank gets its weights: a checkpoint folder, or random weights of a named size
    (or of an explicit config) drawn with `seed`, identical to `models.random_model`'s."""

    model_dir: str | None = None
    random: str | None = None
    config: Any = None  # Phi3SmallConfig for random weights of a custom size
    seed: int = 0
    dtype: str = "float32"  # a torch dtype name
    force_dense: bool = False
    attn_impl: str | None = None
    dummy_token_indices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [x for x in (self.model_dir, self.random, self.config) if x is not None]
        if len(given) != 1:
            raise InputError("ModelSource needs exactly one of model_dir, random or config")
        dtype = getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else None
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise InputError(f"ModelSource.dtype must name a floating-point torch dtype, got {self.dtype!r}")

    def load_config(self):
        from ..models.families import random_config

        if self.model_dir is not None:
            from ..models.families import config_from_file
            from ..models.loader import contained_file

            folder = Path(self.model_dir)
            return config_from_file(contained_file(folder, "config.json", f"checkpoint {folder} has"))
        return random_config(self.random) if self.random is not None else self.config

    def build_model(self, device: torch.device):
        """The whole model in this process, with the default options for `device`."""
        from ..models import load_checkpoint, random_model

        fields = dict(device=device, dtype=getattr(torch, self.dtype), force_dense=self.force_dense,
                      attn_impl=self.attn_impl, dummy_token_indices=self.dummy_token_indices)  # fmt: skip
        if self.model_dir is not None:
            return load_checkpoint(self.model_dir, **fields)
        return random_model(self.load_config(), seed=self.seed, **fields)

    def build(self, shard, device: torch.device, group=None):
        """One rank's shard (a `sharding.TensorParallelPhi3Small` or a
        `decoder_sharding.TensorParallelDecoder`) of the same weights."""
        from ..models.families.config import DecoderConfig
        from ..models.options import ModelOptions
        from .decoder_sharding import random_tp_decoder
        from .loader import load_tp_checkpoint
        from .sharding import random_tp_model

        options = ModelOptions(
            device=device,
            dtype=getattr(torch, self.dtype),
            force_dense=self.force_dense,
            attn_impl=self.attn_impl,
            dummy_token_indices=self.dummy_token_indices,
            triton_gemv=False,  # the GEMV's tiles are tuned for whole 7b layers, not a rank's shards
        )
        if self.model_dir is not None:
            return load_tp_checkpoint(self.model_dir, shard, options, group=group)
        config = self.load_config()
        build = random_tp_decoder if isinstance(config, DecoderConfig) else random_tp_model
        return build(config, shard, options, seed=self.seed, group=group)
