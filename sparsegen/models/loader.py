"""Build a model of any family (`models.families`, by config.json's `model_type`): from a local HF checkpoint folder, or with random weights.

A checkpoint folder holds `config.json` and `*.safetensors`, either sharded with a
`model.safetensors.index.json` weight map or not. Tensors are matched by their HF names,
`…rotary_emb.inv_freq` buffers are skipped, an absent `lm_head.weight` means tied embeddings,
and every tensor is converted to the requested dtype. vLLM's fp8 K/V scales
(`…self_attn.k_scale` / `v_scale`) are kept as `model.kv_scales` for an fp8 KV cache. Anything
missing, unexpected, of the
wrong shape or dtype (weights are float16/bfloat16/float32/float64), or not finite is a
`CheckpointError` that names the file and the tensor. Every file read (config.json, the index,
the shards) must be a regular file inside the folder: index entries such as `../x.safetensors`
or absolute paths, and links that lead outside, are refused (`sparsegen.folders`; links of an HF
hub cache snapshot into its own `blobs/` are allowed). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import folders, jsonio
from .config import CheckpointError, Phi3SmallConfig
from .families import config_from_file, model_class, random_config
from .kv_scales import checked_scales, scale_name
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
    return model_class(config)(config, options).eval().requires_grad_(False)


def random_model(
    config: Phi3SmallConfig | str, options: ModelOptions | None = None, *, seed: int = 0, **fields
) -> Phi3SmallForCausalLM:
    """Random weights (never zeros) scaled so that activations stay O(1).

    The lm_head gets its own random weights: tied to random embeddings, the logits would be
    dominated by the current token and greedy decoding would only repeat it.
    """
    if isinstance(config, str):
        config = random_config(config)
    model = empty_model(config, options, **fields)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            init_random_(name, param, gen)
    return model


def init_random_(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    """Fill the whole (unsharded) tensor `name` as `random_model` does, drawing from `gen`.

    Hook for tensor parallelism: a rank draws each full tensor in the same order, then keeps
    its shard, so its weights are exactly the matching slices of `random_model`'s. The values are
    drawn in the tensor's logical order, so an `in_major` weight gets the same numbers as a
    row-major one."""
    out = param if param.is_contiguous() else torch.empty_like(param, memory_format=torch.contiguous_format)
    if name.endswith(("layernorm.weight", "norm.weight")):
        out.normal_(1.0, 0.1, generator=gen)
    elif name.endswith(".bias"):
        out.normal_(0.0, 0.02, generator=gen)
    elif name == "model.embed_tokens.weight":
        out.normal_(0.0, 0.1, generator=gen)
    elif param.dim() == 1:  # other vectors (gpt-oss's sink logits)
        out.normal_(0.0, 0.02, generator=gen)
    else:
        out.normal_(0.0, param.shape[1] ** -0.5, generator=gen)
    if out is not param:
        param.copy_(out)


WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def contained_file(folder: Path, name: str, what: str) -> Path:
    return folders.contained_file(folder, name, what, CheckpointError)


def _index_weight_map(folder: Path) -> dict[str, Path]:
    index_path = contained_file(folder, INDEX_FILE, f"checkpoint {folder} has")
    index = jsonio.read_json_file(index_path, CheckpointError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path} has no 'weight_map' object of tensor name -> file name")
    files: dict[str, Path] = {}
    checked: dict[str, Path] = {}
    for name, file in weight_map.items():
        if file not in checked:
            what = f"{index_path} maps tensor {name!r:.120} to"
            path = contained_file(folder, file, what)
            if not file.endswith(".safetensors"):
                raise CheckpointError(f"{what} {file!r:.120}, which is not a .safetensors file")
            checked[file] = path
        files[name] = checked[file]
    return files


def _open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _scan_weight_map(folder: Path) -> dict[str, Path]:
    shards = [
        contained_file(folder, p.name, f"checkpoint {folder} has")
        for p in sorted(folder.glob("*.safetensors"))
    ]
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


def checked_values(tensor: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    """A weight read from `path`: a float dtype and finite values, else a CheckpointError naming it."""
    if tensor.dtype not in WEIGHT_DTYPES:
        raise CheckpointError(
            f"tensor {name!r} in {path} has dtype {tensor.dtype}; weights must be float16, bfloat16, "
            "float32 or float64"
        )
    if not torch.isfinite(tensor).all():
        raise CheckpointError(f"tensor {name!r} in {path} is not finite floating point (NaN or inf)")
    return tensor


def checked_tensor(f, name: str, path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor `name` of an open safetensors file (the caller saw it listed), checked: readable,
    the shape the config implies, then `checked_values`. Every failure is a CheckpointError."""
    try:
        tensor = f.get_tensor(name)
    except Exception as exc:  # noqa: BLE001 - safetensors/torch raise several types for bad data
        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}, but config.json implies {tuple(shape)}"
        )
    return checked_values(tensor, name, path)


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
    return load_into(
        folder, options, fields, empty_model, lambda f, name, path, param, config: checked_tensor(
            f, name, path, tuple(param.shape)
        ),
    )  # fmt: skip


def load_into(folder, options: ModelOptions | None, fields: dict, build, read):
    """The load every loader shares: the options (dtype bfloat16 unless given), config.json and
    the weight map, the model from build(config, options), then each safetensors file opened once
    and every tensor of it copied in through read(f, name, path, param, config) (which checks and
    may slice it), then `finish_load`. Every failure is a CheckpointError naming the tensor/file."""
    if options is None:
        fields.setdefault("dtype", torch.bfloat16)
    options = ModelOptions.of(options, **fields)
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config = config_from_file(contained_file(folder, "config.json", f"checkpoint {folder} has"))
    weight_map = checkpoint_weight_map(folder)
    model = build(config, options)
    params = (
        model.checkpoint_params() if hasattr(model, "checkpoint_params") else dict(model.named_parameters())
    )
    by_file: dict[Path, list[str]] = {}
    scale_files: dict[Path, list[str]] = {}  # fp8 K/V scales (vLLM's names): read for the KV cache
    for name, path in weight_map.items():
        if name.endswith(SKIPPED_SUFFIXES):
            continue
        if scale_name(name) is not None:
            scale_files.setdefault(path, []).append(name)
            continue
        if name not in params:
            raise CheckpointError(
                f"{path} holds tensor {name!r}, which the {getattr(config, 'model_type', 'phi3small')} model has no place for"
            )
        by_file.setdefault(path, []).append(name)
    loaded: set[str] = set()
    with torch.no_grad():
        for path, names in by_file.items():
            with _open(path) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{path} lacks tensor {name!r} (listed there by {INDEX_FILE})")
                    params[name].copy_(read(f, name, path, params[name], config))
                    loaded.add(name)
    model.kv_scales = _read_scales(scale_files, config, folder)
    return finish_load(model, params, loaded, folder, config)


def _read_scales(scale_files: dict[Path, list[str]], config, folder: Path) -> dict:
    """The checkpoint's `…self_attn.k_scale` / `v_scale` tensors, checked (`kv_scales.checked_scales`):
    layer -> (k_scale, v_scale), what an fp8 KV cache starts from (`runner.kv_cache`)."""
    found = {}
    for path, names in scale_files.items():
        with _open(path) as f:
            for name in names:
                try:
                    found[scale_name(name)] = f.get_tensor(name)
                except Exception as exc:  # noqa: BLE001 - safetensors raises several types for bad data
                    raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from None
    return checked_scales(found, config.num_hidden_layers, config.num_key_value_heads, f"checkpoint {folder}")


def finish_load(model, params: dict, loaded: set[str], folder, config):
    """Every parameter was read, or lm_head is tied to the embedding as config.json allows."""
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
