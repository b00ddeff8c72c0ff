"""`sparsegen show`: per-head density of one layer and a picture of its block mask."""

from __future__ import annotations

import importlib.util
import json
import os

import click
import torch

from .. import dtypes
from ..errors import MissingExtraError
from ..layout import block_mask, density
from ..log import get_logger
from .options import kv_cache_dtype_option, load_pattern, pick_layer

log = get_logger(__name__)

# The ASCII picture is at most this many cells wide; larger masks are pooled (any-visible).
_PICTURE_CELLS = 64
# What `--png FILE` may end in: formats matplotlib's Agg and vector backends write.
IMAGE_FORMATS = frozenset({"png", "svg", "pdf", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff"})


def ascii_block_mask(mask: torch.Tensor) -> str:
    """'#' where a (query block, key block) pair has any visible key, '.' elsewhere (causal part)."""
    n = mask.shape[0]
    step = -(-n // _PICTURE_CELLS)
    if step > 1:
        pad = step * -(-n // step) - n
        padded = torch.nn.functional.pad(mask.float(), (0, pad, 0, pad))
        mask = torch.nn.functional.max_pool2d(padded[None], step)[0] > 0
    lines = []
    for a, row in enumerate(mask.tolist()):
        lines.append("".join("#" if v else ("." if b <= a else " ") for b, v in enumerate(row)))
    return "\n".join(lines)


@click.command(name="show")
@click.option(
    "--pattern", "pattern", required=True, help="Preset name, sparsegen JSON spec or HF config.json."
)
@click.option("--layer", type=int, default=None, help="Layer index (default: the first sparse layer).")
@click.option("--seq-len", type=click.IntRange(1, 1 << 20), default=8192, show_default=True)
@click.option("--head", type=int, default=0, show_default=True, help="Head whose block mask is drawn.")
@click.option("--json", "as_json", is_flag=True, help="Print the densities as JSON.")
@click.option(
    "--png",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write a picture: the block mask of each distinct head pattern and the pages each KV group "
    "reads in decode (needs matplotlib; the extension picks the format).",
)
@click.option(
    "--page-size",
    type=click.IntRange(1, 1 << 16),
    default=16,
    show_default=True,
    help="Decode pages in --png, and the page size of the decode kernel named.",
)
@kv_cache_dtype_option
def command(
    pattern: str,
    layer: int | None,
    seq_len: int,
    head: int,
    as_json: bool,
    png: str | None,
    page_size: int,
    kv_cache_dtype: str = "auto",
) -> None:
    """Show per-head density (visible pairs / causal pairs) and the block mask of one layer."""
    if png is not None:
        png = _check_png(png)  # before anything is printed
    model = load_pattern(pattern)
    index = pick_layer(model, layer)
    spec = model.layers[index]
    if not 0 <= head < spec.num_heads:
        raise click.BadParameter(
            f"head {head} is out of range 0..{spec.num_heads - 1}", param_hint="'--head'"
        )
    dens = density(spec, seq_len).tolist()
    if as_json:
        heads = [{"head": h, "kv_head": spec.kv_head(h), "density": d} for h, d in enumerate(dens)]
        click.echo(json.dumps({"pattern": model.name, "layer": index, "seq_len": seq_len, "heads": heads,
                               **_features(spec), **_decode_kv(spec, kv_cache_dtype, page_size)}))  # fmt: skip
    else:
        click.echo(
            f"{model.name}: layer {index} of {len(model.layers)}, seq_len {seq_len}, "
            f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}"
        )
        click.echo("head  kv  kind               density")
        for h, d in enumerate(dens):
            click.echo(f"{h:>4}  {spec.kv_head(h):>2}  {spec.heads[h].kind:<17}  {d:.4f}")
        click.echo(f"mean  {'':>2}  {'':<17}  {sum(dens) / len(dens):.4f}")
        block = spec.heads[head].block_size
        picture_len = min(seq_len, _PICTURE_CELLS * block)
        mask = block_mask(spec, picture_len, block)[head]
        click.echo(
            f"\nblock mask of head {head}, first {picture_len} tokens in blocks of {block} "
            "(rows: query blocks, columns: key blocks; '#' visible, '.' causal but skipped)"
        )
        click.echo(ascii_block_mask(mask))
        info = _features(spec)
        sinks = ", ".join(f"{h}: {n}" for h, n in enumerate(info["sink_tokens"]) if n) or "none"
        click.echo(
            f"\nsoft-cap {info['logit_softcap'] or 'off'}, learned sinks {'on' if info['learned_sinks'] else 'off'}, "
            f"scale {info['scale']:.6g} ({'the layer' if spec.scale is not None else '1/sqrt(head_dim)'}), "
            f"sink tokens per head: {sinks}"
        )
        click.echo(f"prefill kernel on sm_90: {info['prefill_sm90']}")
        kv = _decode_kv(spec, kv_cache_dtype, page_size)
        click.echo(f"KV cache dtype: {kv['kv_cache_dtype']} ({kv['kv_torch_dtype']}); decode kernel (bf16 q): "
                   f"{kv['decode_kernel']}")  # fmt: skip
    if png is not None:
        from ..figure import draw

        draw(spec, seq_len, png, f"{model.name} layer {index}", page_size=page_size)
        log.info(f"wrote {png}")


def _check_png(path: str) -> str:
    """`path` once matplotlib is importable and can write it: MissingExtraError without matplotlib,
    a usage error for a missing folder or a format matplotlib cannot write."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError("--png needs matplotlib: pip install 'sparsegen[plot]'")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"folder {folder} does not exist", param_hint="'--png'")
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in IMAGE_FORMATS:
        raise click.BadParameter(
            f"{path!r} has no image extension matplotlib writes ({', '.join(sorted(IMAGE_FORMATS))})",
            param_hint="'--png'",
        )
    return path


def _decode_kv(spec, kv_cache_dtype: str, page_size: int) -> dict:
    """The KV cache's dtype (`--kv-cache-dtype`; auto: the model's) and the name of the decode
    kernel that reads it for bf16 q (a bf16 model); a page size the kernel does not take names none."""
    from ..kernels import decode_template

    kv = None if kv_cache_dtype == "auto" else dtypes.KV_CACHE_DTYPE_NAMES[kv_cache_dtype]
    name = None
    if page_size in decode_template.PAGE_SIZES and spec.head_dim in decode_template.HEAD_DIMS:
        name = decode_template.kernel_name(spec, "bf16", page_size, dtypes.kv_kernel_name(kv))
    torch_name = "the model's dtype" if kv is None else str(kv).removeprefix("torch.")
    return {"kv_cache_dtype": kv_cache_dtype, "kv_torch_dtype": torch_name, "decode_kernel": name}


def _features(spec) -> dict:
    """The layer's attention features and which prefill kernel variant it gets on sm_90 (the
    Gluon kernel when it covers the layer, with the tile width a padded head_dim runs in, else
    the tl kernel, with the reason)."""
    from ..kernels import prefill_gluon_template

    why = prefill_gluon_template.covers(spec, "bf16")
    tile = prefill_gluon_template.tile_dim(spec.head_dim)
    padded = f" (head_dim {spec.head_dim} in {tile}-wide tiles)" if tile != spec.head_dim else ""
    variant = f"gluon{padded}" if why is None else f"tl (Gluon does not cover {why})"
    return {
        "logit_softcap": spec.logit_softcap,
        "learned_sinks": spec.learned_sinks,
        "scale": spec.default_scale,
        "sink_tokens": [h.sink_tokens for h in spec.heads],
        "prefill_sm90": variant,
    }
