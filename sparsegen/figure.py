"""One picture of a layer's pattern (`sparsegen show --png`), drawn with matplotlib.

- Top: the block mask of each *distinct* head pattern (heads sharing a spec share a panel), axes
  in tokens, three colours: visible, causal but skipped, not causal (above the diagonal). The
  title names the heads, the pattern kind and its density (visible / causal pairs) at seq_len.
- Bottom: for decode at the last position, the pages each KV group reads: the union over the
  group's query heads, which is what the decode kernel loads. The labels give the fraction of
  the pages it reads.
"""

from __future__ import annotations

import torch

from .layout import block_mask, decode_pages, density
from .spec import LayerSpec

VISIBLE, SKIPPED, NON_CAUSAL = "#1f4e9c", "#dfe3ea", "#ffffff"
MAX_TILES = 128  # tiles per axis of one mask panel


def picture_tile(spec: LayerSpec, seq_len: int) -> tuple[int, int]:
    """(tile, length): the heads' block size (the smallest sparse one), doubled until the first
    `length = min(seq_len, MAX_TILES * tile)` tokens fit in MAX_TILES tiles."""
    sizes = [h.block_size for h in spec.heads if not h.dense] or [spec.heads[0].block_size]
    tile = min(sizes)
    while -(-seq_len // tile) > MAX_TILES and tile < 4096:
        tile *= 2
    return tile, min(seq_len, MAX_TILES * tile)


def distinct_heads(spec: LayerSpec) -> list[list[int]]:
    """Head indices grouped by identical HeadSpec, in order of first appearance."""
    groups: dict = {}
    for h, head in enumerate(spec.heads):
        groups.setdefault(head, []).append(h)
    return list(groups.values())


def _head_list(heads: list[int]) -> str:
    if len(heads) > 2 and heads == list(range(heads[0], heads[-1] + 1)):
        return f"heads {heads[0]}-{heads[-1]}"
    shown = ", ".join(map(str, heads[:6])) + (", ..." if len(heads) > 6 else "")
    return ("head " if len(heads) == 1 else "heads ") + shown


def draw(spec: LayerSpec, seq_len: int, path: str, title: str, *, page_size: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    tile, length = picture_tile(spec, seq_len)
    masks = block_mask(spec, length, tile)  # [H, nb, nb] bool
    nb = masks.shape[1]
    causal = torch.ones(nb, nb, dtype=torch.bool).tril()
    dens = density(spec, seq_len).tolist()
    groups = distinct_heads(spec)
    cols = min(4, len(groups))
    rows = -(-len(groups) // cols)
    fig = plt.figure(figsize=(4.2 * cols, 4.3 * rows + 2.6), layout="constrained")
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[4.3] * rows + [2.0])
    cmap = ListedColormap([NON_CAUSAL, SKIPPED, VISIBLE])
    for n, heads in enumerate(groups):
        ax = fig.add_subplot(grid[n // cols, n % cols])
        picture = causal.long() + masks[heads[0]].long()  # 0 non-causal, 1 skipped, 2 visible
        ax.imshow(picture.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
                  extent=(0, nb * tile, nb * tile, 0))  # fmt: skip
        ax.set_xlim(0, length)
        ax.set_ylim(length, 0)
        head = spec.heads[heads[0]]
        ax.set_title(f"{_head_list(heads)}: {head.kind}\ndensity {dens[heads[0]]:.3f} at {seq_len} tokens",
                     fontsize=9)  # fmt: skip
        ax.tick_params(labelsize=7)
        if n % cols == 0:
            ax.set_ylabel("query position (tokens)", fontsize=8)
        if n // cols == rows - 1:
            ax.set_xlabel("key position (tokens)", fontsize=8)

    pages = decode_pages(spec, seq_len, page_size)  # [Hkv, num_pages] bool
    ax = fig.add_subplot(grid[rows, :])
    ax.imshow((pages.long() + 1).numpy(), cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest",
              extent=(0, pages.shape[1] * page_size, spec.num_kv_heads - 0.5, -0.5))  # fmt: skip
    ax.set_xlim(0, seq_len)
    share = pages.float().mean(dim=1).tolist()
    group = spec.group_size
    ax.set_yticks(range(spec.num_kv_heads))
    ax.set_yticklabels(
        [f"kv {g} (q {g * group}-{g * group + group - 1}): {s:.0%}" if group > 1 else f"kv {g}: {s:.0%}"
         for g, s in enumerate(share)],
        fontsize=7,
    )  # fmt: skip
    ax.set_xlabel("key position (tokens)", fontsize=8)
    ax.set_title(
        f"decode at position {seq_len - 1}: the {page_size}-token pages each KV group reads "
        f"(union over its {group} query head{'s' if group > 1 else ''}), "
        f"{pages.float().mean():.0%} of all pages",
        fontsize=9,
    )
    ax.tick_params(axis="x", labelsize=7)
    fig.legend(
        handles=[
            Patch(facecolor=VISIBLE, edgecolor="#888", label="visible (read)"),
            Patch(facecolor=SKIPPED, edgecolor="#888", label="causal but skipped"),
            Patch(facecolor=NON_CAUSAL, edgecolor="#888", label="not causal"),
        ],
        loc="outside upper right",
        ncols=3,
        fontsize=9,
    )
    fig.suptitle(
        f"{title}: {spec.num_heads} heads ({len(groups)} distinct), {spec.num_kv_heads} KV heads; "
        f"block masks of the first {length} tokens in tiles of {tile}",
        fontsize=11,
        x=0.02,
        ha="left",
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
