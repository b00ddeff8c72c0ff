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

from .config import CheckpointError, Phi3SmallConfig
from .loader import (
    INDEX_FILE,
    SKIPPED_SUFFIXES,
    WEIGHT_DTYPES,
    _open,
    checkpoint_weight_map,
    contained_file,
    finish_load,
)
from .options import ModelOptions
from .tensor_parallel import TensorParallelPhi3Small, TPShard, full_shape, shard_range, take_shard


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
    if tensor.dtype not in WEIGHT_DTYPES:
        raise CheckpointError(
            f"tensor {name!r} in {path} has dtype {tensor.dtype}; weights must be float16, bfloat16, "
            "float32 or float64"
        )
    if not torch.isfinite(tensor).all():
        raise CheckpointError(f"tensor {name!r} in {path} is not finite floating point (NaN or inf)")
    return tensor


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
    if options is None:
        fields.setdefault("dtype", torch.bfloat16)
    options = ModelOptions.of(options, **fields)
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config = Phi3SmallConfig.from_file(contained_file(folder, "config.json", f"checkpoint {folder} has"))
    weight_map = checkpoint_weight_map(folder)
    model = TensorParallelPhi3Small(config, shard, options, group=group)
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_map.items():
        if name.endswith(SKIPPED_SUFFIXES):
            continue
        if name not in params:
            raise CheckpointError(f"{path} holds tensor {name!r}, which Phi-3-Small has no place for")
        by_file.setdefault(path, []).append(name)
    loaded: set[str] = set()
    with torch.no_grad():
        for path, names in by_file.items():
            with _open(path) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{path} lacks tensor {name!r} (listed there by {INDEX_FILE})")
                    params[name].copy_(_read(f, name, path, params[name], config, shard))
                    loaded.add(name)
    return finish_load(model, params, loaded, folder, config)
