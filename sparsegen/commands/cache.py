"""`sparsegen cache dir|ls|clear`: where the kernel cache is, what it holds, and emptying it."""

from __future__ import annotations

import json

import click

from ..bench.common import format_table


@click.group(name="cache")
def command():
    """Inspect or clear the kernel cache (SPARSEGEN_CACHE_DIR, default ~/.cache/sparsegen)."""


@command.command(name="dir")
def cache_dir_cmd():
    """Print the cache directory."""
    from ..jit import cache

    click.echo(str(cache.cache_dir()))


@command.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def cache_ls(as_json):
    """List the cached kernels."""
    from ..jit import cache

    entries = cache.list_entries()
    if as_json:
        click.echo(json.dumps(entries, indent=1))
        return
    if not entries:
        click.echo(f"the cache at {cache.cache_dir()} is empty")
        return
    rows = []
    for e in entries:
        meta = e["meta"]
        state = "corrupt" if meta.get("corrupt") else meta.get("kind", "?")
        rows.append([e["key"], state, meta.get("arch", "?"), meta.get("dtype", "?"), e["bytes"]])
    click.echo(format_table(["key", "kind", "arch", "dtype", "bytes"], rows))


@command.command(name="clear")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Remove every cached kernel."""
    from ..jit import cache

    root = cache.cache_dir()
    if not yes:
        click.confirm(f"remove every kernel cached in {root}?", abort=True)
    click.echo(f"removed {cache.clear()} entries from {root}")
