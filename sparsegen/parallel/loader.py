"""Load one tensor-parallel rank's part of a normal HF checkpoint folder.

The folder is the one `loader.load_checkpoint` reads (config.json plus *.safetensors, sharded
with an index or not). Each rank opens every file but reads only its rows or columns of each
sharded tensor, through safetensors' `get_slice` (nothing else is read from disk), and the
replicated tensors whole. The checks are `load_checkpoint`'s: unknown, missing, wrongly shaped
(against the *full* shape that config.json implies) or non-finite tensors are a
`CheckpointError` naming the file and the tensor; an absent `lm_head.weight` means tied
embeddings. A decoder family's rank (`decoder_sharding`) reads its rows of q_proj, k_proj,
v_proj, gate_proj and up_proj into its fused qkv_proj and gate_up_proj.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.config import CheckpointError
from ..models.families.config import DecoderConfig
from ..models.loader import checked_values, load_into
from ..models.options import ModelOptions
from . import decoder_sharding, sharding
from .decoder_sharding import TensorParallelDecoder
from .sharding import TensorParallelPhi3Small, TPShard


def _rules(config):
    """The module whose shard_range / full_shape / take_shard cut this config's tensors."""
    return decoder_sharding if isinstance(config, DecoderConfig) else sharding


def tp_model_class(config) -> type:
    return TensorParallelDecoder if isinstance(config, DecoderConfig) else TensorParallelPhi3Small


def _read(f, name: str, path: Path, model_param, config, shard) -> torch.Tensor:
    try:
        view = f.get_slice(name)
        shape = tuple(view.get_shape())
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None
    rules = _rules(config)
    want = rules.full_shape(name, model_param, config, shard)
    if shape != want:
        raise CheckpointError(f"tensor {name!r} in {path} has shape {shape}, but config.json implies {want}")
    try:
        if rules.shard_range(name, config, shard) is None:
            tensor = f.get_tensor(name)
        else:
            tensor = rules.take_shard(name, view, config, shard, model_param)
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None
    return checked_values(tensor, name, path)


def load_tp_checkpoint(
    folder: str | Path,
    shard: TPShard,
    options: ModelOptions | None = None,
    *,
    group=None,
    **fields,
) -> TensorParallelPhi3Small | TensorParallelDecoder:
    """This rank's part of the checkpoint, built as `options` (or ModelOptions fields as
    keywords) say; the dtype defaults to bfloat16 here, as in `load_checkpoint`."""
    return load_into(
        folder, options, fields, lambda config, opts: tp_model_class(config)(config, shard, opts, group=group),
        lambda f, name, path, param, config: _read(f, name, path, param, config, shard),
    )  # fmt: skip
