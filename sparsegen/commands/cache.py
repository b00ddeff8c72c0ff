"""`sparsegen cache dir|ls|verify|sweep|clear`: where the kernel cache is, what it holds and whether
each entry still verifies, and cleaning it up."""

from __future__ import annotations

import json

import click

from ..log import get_logger
from .table import format_table


@click.group(name="cache")
def command():
    """Inspect, verify or clear the kernel cache (SPARSEGEN_CACHE_DIR, default ~/.cache/sparsegen)."""


@command.command(name="dir")
def cache_dir_cmd():
    """Print the cache directory."""
    from ..jit import cache

    click.echo(str(cache.cache_dir()))


def _short(value, width: int = 12) -> str:
    """A manifest value for a table cell: plain scalars only, cut to `width`."""
    return str(value)[:width] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else "?"


def _verdict(entry) -> str:
    return "ok" if entry["ok"] else f"BAD: {entry['problem']}"


def _table(entries) -> str:
    rows = []
    for e in entries:
        meta = e["meta"]
        rows.append(
            [
                e["key"],
                _short(meta.get("kind")),
                _short(meta.get("arch")),
                _short(meta.get("dtype"))
                + (f" kv {_short(meta['kv_dtype'])}" if meta.get("kv_dtype") else ""),
                e["bytes"],
                _verdict(e),
            ]
        )
    return format_table(["key", "kind", "arch", "dtype", "bytes", "verdict"], rows)


@command.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def cache_ls(as_json):
    """List the cached kernels, each re-hashed (verdict "ok" or "BAD: why")."""
    from ..jit import cache

    entries = cache.list_entries()
    if as_json:
        click.echo(json.dumps(entries, indent=1))
        return
    if not entries:
        click.echo(f"the cache at {cache.cache_dir()} is empty")
        return
    click.echo(_table(entries))


@command.command(name="verify")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per entry.")
def cache_verify(as_json):
    """Re-check and re-hash every file of every entry; exit 1 if any entry is bad."""
    from ..jit import cache

    entries = cache.verify_entries()
    bad = [e for e in entries if not e["ok"]]
    if as_json:
        click.echo(json.dumps(entries, indent=1))
    else:
        for e in entries:
            click.echo(
                f"{'ok ' if e['ok'] else 'BAD'}  {e['key']}" + ("" if e["ok"] else f": {e['problem']}")
            )
    get_logger(__name__).info(
        f"{len(entries) - len(bad)} of {len(entries)} entries verify in {cache.cache_dir()}"
    )
    if bad:
        raise click.exceptions.Exit(1)


@command.command(name="sweep")
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="Seconds a .tmp-* build folder must be untouched (and its lock free) to count as stale.",
)
def cache_sweep(older_than):
    """Remove killed builds' .tmp-* folders and quarantined entries that you own."""
    from ..jit import cache

    removed = cache.sweep(older_than)
    click.echo(f"removed {len(removed)} leftovers from {cache.cache_dir()}")


@command.command(name="clear")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Remove every cached kernel."""
    from ..jit import cache

    root = cache.cache_dir()
    if not yes:
        click.confirm(f"remove every kernel cached in {root}?", abort=True)
    click.echo(f"removed {cache.clear()} entries from {root}")
