"""Load one tensor-parallel rank's part of a normal HF checkpoint folder.

The folder is the one `loader.load_checkpoint` reads (config.json plus *.safetensors, sharded
with an index or not). Each rank opens every file but reads only its rows or columns of each
sharded tensor, through safetensors' `get_slice` (nothing else is read from disk), and the
replicated tensors whole. The checks are `load_checkpoint`'s: unknown, missing, wrongly shaped
(against the *full* shape that config.json implies) or non-finite tensors are a
`CheckpointError` naming the file and the tensor; an absent `lm_head.weight` means tied
embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.config import CheckpointError
from ..models.loader import checked_values, load_into
from ..models.options import ModelOptions
from .sharding import TensorParallelPhi3Small, TPShard, full_shape, shard_range, take_shard


def _read(f, name: str, path: Path, model_param: torch.Tensor, config, shard) -> torch.Tensor:
    try:
        view = f.get_slice(name)
        shape = tuple(view.get_shape())
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None
    want = full_shape(name, model_param, config, shard)
    if shape != want:
        raise CheckpointError(f"tensor {name!r} in {path} has shape {shape}, but config.json implies {want}")
    try:
        if shard_range(name, config, shard) is None:
            tensor = f.get_tensor(name)
        else:
            tensor = take_shard(name, view, config, shard, model_param)
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
) -> TensorParallelPhi3Small:
    """This rank's part of the checkpoint, built as `options` (or ModelOptions fields as
    keywords) say; the dtype defaults to bfloat16 here, as in `load_checkpoint`."""
    return load_into(
        folder, options, fields, lambda config, opts: TensorParallelPhi3Small(config, shard, opts, group=group),
        lambda f, name, path, param, config: _read(f, name, path, param, config, shard),
    )  # fmt: skip
