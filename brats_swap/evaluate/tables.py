"""Result tables on the terminal that never cut a number.

Rich shrinks a table wider than the terminal by truncating cells ("Lesi…", "373.…"). Here every column
may wrap (header words go on separate lines) but none is narrower than its longest word, so a number is
either shown whole or moved whole to the next line; a table that still cannot fit is wider than the
terminal rather than wrong.
"""

from __future__ import annotations

from collections.abc import Sequence


def print_results_table(console, header: Sequence[str], body: Sequence[Sequence[str]], *, title: str = "",
                        caption: str = "") -> None:
    """Print `header` and `body` (cells as text; the first column left-aligned, the others right-aligned)."""
    from rich.table import Table

    table = Table(title=title or None, caption=caption or None)
    for index, name in enumerate(header):
        words = [word for cells in body for word in str(cells[index]).split()] + str(name).split()
        table.add_column(name, justify="left" if index == 0 else "right", overflow="fold",
                         min_width=max((len(word) for word in words), default=1))
    for cells in body:
        table.add_row(*cells)
    console.print(table)


__all__ = ["print_results_table"]
