"""Build a Phi-3-Small model: from a local HF checkpoint folder, or with random weights.

A checkpoint folder holds `config.json` and `*.safetensors`, either sharded with a
`model.safetensors.index.json` weight map or not. Tensors are matched by their HF names,
`…rotary_emb.inv_freq` buffers are skipped, an absent `lm_head.weight` means tied embeddings,
and every tensor is converted to the requested dtype. Anything missing, unexpected or of the
wrong shape is a `CheckpointError` that names the file and the tensor. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import CheckpointError, Phi3SmallConfig, named_config
from .memory import check_model_fits
from .options import ModelOptions
from .phi3small import Phi3SmallForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def empty_model(
    config: Phi3SmallConfig, options: ModelOptions | None = None, **fields
) -> Phi3SmallForCausalLM:
    """A model with allocated, uninitialised weights (no init cost), built as `options` (or the
    ModelOptions fields given as keywords) say. The weights' size is checked against the device's
    free memory first (`MemoryLimitError`)."""
    options = ModelOptions.of(options, **fields)
    check_model_fits(config, options.dtype, options.device)
    return Phi3SmallForCausalLM(config, options).eval().requires_grad_(False)


def random_model(
    config: Phi3SmallConfig | str, options: ModelOptions | None = None, *, seed: int = 0, **fields
) -> Phi3SmallForCausalLM:
    """Random weights (never zeros) scaled so that activations stay O(1).

    The lm_head gets its own random weights: tied to random embeddings, the logits would be
    dominated by the current token and greedy decoding would only repeat it.
    """
    if isinstance(config, str):
        config = named_config(config)
    model = empty_model(config, options, **fields)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.normal_(1.0, 0.1, generator=gen)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.02, generator=gen)
            elif name == "model.embed_tokens.weight":
                param.normal_(0.0, 0.1, generator=gen)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)
    return model


def _index_weight_map(folder: Path) -> dict[str, Path]:
    index_path = folder / INDEX_FILE
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {index_path}: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path} has no 'weight_map' object of tensor name -> file name")
    files = {}
    for name, file in weight_map.items():
        path = folder / file
        if not path.is_file():
            raise CheckpointError(f"{index_path} maps tensor {name!r} to {file}, which does not exist")
        files[name] = path
    return files


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _scan_weight_map(folder: Path) -> dict[str, Path]:
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder} has no *.safetensors files (and no {INDEX_FILE})")
    files: dict[str, Path] = {}
    for path in shards:
        with _open(path) as f:
            for name in f.keys():
                if name in files:
                    raise CheckpointError(f"tensor {name!r} appears in both {files[name]} and {path}")
                files[name] = path
    return files


def checkpoint_weight_map(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    folder = Path(folder)
    if (folder / INDEX_FILE).exists():
        return _index_weight_map(folder)
    return _scan_weight_map(folder)


def load_checkpoint(
    folder: str | Path, options: ModelOptions | None = None, **fields
) -> Phi3SmallForCausalLM:
    """The checkpoint's model, built as `options` (or its fields as keywords) say; the dtype
    defaults to bfloat16 here."""
    if options is None:
        fields.setdefault("dtype", torch.bfloat16)
    options = ModelOptions.of(options, **fields)
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config_path = folder / "config.json"
    config = Phi3SmallConfig.from_file(config_path)
    weight_map = checkpoint_weight_map(folder)
    model = empty_model(config, options)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_map.items():
        if name.endswith(SKIPPED_SUFFIXES):
            continue
        if name not in params:
            raise CheckpointError(f"{path} holds tensor {name!r}, which Phi-3-Small has no place for")
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with _open(path) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{path} lacks tensor {name!r} (listed there by {INDEX_FILE})")
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as exc:
                        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None
                    param = params[name]
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise CheckpointError(
                            f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, "
                            f"but config.json implies {tuple(param.shape)}"
                        )
                    if not (tensor.is_floating_point() and torch.isfinite(tensor).all()):
                        raise CheckpointError(f"tensor {name!r} in {path} is not finite floating point")
                    param.copy_(tensor)
                    loaded.add(name)
    missing = [n for n in params if n not in loaded and n != "lm_head.weight"]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {folder} lacks tensor {missing[0]!r}{more}")
    if "lm_head.weight" not in loaded:
        if not config.tie_word_embeddings:
            raise CheckpointError(
                f"checkpoint {folder} lacks tensor 'lm_head.weight' and config.json sets "
                "tie_word_embeddings=false"
            )
        model.tie_embeddings()
    return model
