"""`sparsegen patterns`: list the preset patterns."""

from __future__ import annotations

import json

import click

from ..presets import PRESETS, get_pattern


@click.command(name="patterns")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def command(as_json: bool) -> None:
    """List the preset patterns that --pattern accepts (a JSON spec or config.json works too)."""
    rows = []
    for name, (_, about) in PRESETS.items():
        model = get_pattern(name)
        sparse = sum(not layer.is_dense for layer in model.layers)
        rows.append({"name": name, "layers": len(model.layers), "sparse_layers": sparse, "about": about})
    if as_json:
        click.echo(json.dumps(rows))
        return
    width = max(len(r["name"]) for r in rows)
    click.echo(f"{'name':<{width}}  layers  sparse  description")
    for r in rows:
        click.echo(f"{r['name']:<{width}}  {r['layers']:>6}  {r['sparse_layers']:>6}  {r['about']}")
