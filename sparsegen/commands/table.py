"""The fixed-width tables that `compile`, `cache` and `bench` print without --json."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width table (numbers get 3 significant decimals)."""

    def cell(x) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    cells = [[cell(x) for x in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
