"""Files inside a folder someone else wrote (a checkpoint, a tokenizer): never outside it.

`contained_file(folder, name, ...)` refuses absolute names, `..` components, NUL bytes, a name or
link that resolves outside the folder, and anything that is not a regular file (a FIFO would
block the reader, a device would never end). One exception keeps Hugging Face's cache usable: a
snapshot folder `models--org--name/snapshots/<rev>/` links each file to `../../blobs/<hash>`,
so links from a snapshot into its own repository's `blobs/` are followed.
"""

from __future__ import annotations

from pathlib import Path


def hub_blobs(folder: Path) -> Path | None:
    """The `blobs/` folder of the HF hub cache repository that `folder` is a snapshot of, if any."""
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        return (folder.parent.parent / "blobs").resolve()
    return None


def contained_file(folder: Path, name: str, what: str, error: type[Exception]) -> Path:
    """`folder / name` if it is a regular file inside `folder`; else `error` with the message
    `what`, the name and the reason."""
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts or "\0" in name:
        raise error(f"{what} {name!r:.120}, which is not a file name inside {folder}")
    path = folder / rel
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, or a loop of links
        raise error(f"{what} {name!r:.120}, which does not exist ({type(exc).__name__})") from None
    root = folder.resolve()
    blobs = hub_blobs(folder)
    if not (real.is_relative_to(root) or (blobs is not None and real.is_relative_to(blobs))):
        raise error(f"{what} {name!r:.120}, which leads outside {folder} (to {real})")
    if not real.is_file():
        raise error(f"{what} {name!r:.120}, which is not a regular file")
    return path
