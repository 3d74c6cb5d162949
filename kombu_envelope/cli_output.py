"""How the command-line tools print: aligned tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import click


def echo_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print ``rows`` under ``headers``, each column as wide as its widest cell."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    click.echo(line.format(*headers))
    click.echo(line.format(*("-" * w for w in widths)))
    for row in cells:
        click.echo(line.format(*row))
