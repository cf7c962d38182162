"""Result tables on the terminal that never cut a number.

Rich fits a table wider than the terminal by truncating cells ("Lesi…", "373.…") and crops what still
does not fit. Here every column may wrap (header words go on separate lines) but is never narrower than
its longest word, so a number is shown whole or moved whole to the next line; when even that is wider than
the terminal, the columns are split over several tables, each repeating the first (row name) column.
"""

from __future__ import annotations

from collections.abc import Sequence

# Rich's box table: one border character per column plus the closing one, and one space of padding on
# each side of a cell.
_BORDER, _PADDING = 1, 2


def _min_width(name: str, cells: Sequence[str]) -> int:
    words = [word for cell in cells for word in str(cell).split()] + str(name).split()
    return max((len(word) for word in words), default=1)


def _column_groups(widths: Sequence[int], space: int) -> list[list[int]]:
    """Indexes of the value columns (1...) for each table beside column 0, in as few tables as fit in
    `space`, with the columns spread evenly over them (no table of one stray column)."""
    base = _BORDER + widths[0] + _PADDING + _BORDER

    def fits(columns: Sequence[int]) -> bool:
        return len(columns) <= 1 or base + sum(widths[i] + _PADDING + _BORDER for i in columns) <= space

    values = list(range(1, len(widths)))
    for parts in range(1, len(values) + 1):
        size = -(-len(values) // parts)  # ceiling: the first tables take one column more than the last
        groups = [values[start:start + size] for start in range(0, len(values), size)]
        if all(fits(group) for group in groups):
            return groups
    return [[index] for index in values]


def print_results_table(console, header: Sequence[str], body: Sequence[Sequence[str]], *, title: str = "",
                        caption: str = "") -> None:
    """Print `header` and `body` (cells as text; the first column left-aligned, the others right-aligned)."""
    from rich.table import Table

    widths = [_min_width(name, [row[index] for row in body]) for index, name in enumerate(header)]
    groups = _column_groups(widths, console.width) if len(header) > 1 else [[]]
    for part, columns in enumerate(groups):
        shown = [0, *columns]
        suffix = f" ({part + 1}/{len(groups)})" if len(groups) > 1 and title else ""
        table = Table(title=f"{title}{suffix}" or None, caption=(caption or None) if part == len(groups) - 1 else None)
        for index in shown:
            table.add_column(header[index], justify="left" if index == 0 else "right", overflow="fold",
                             min_width=widths[index])
        for cells in body:
            table.add_row(*(cells[index] for index in shown))
        console.print(table)


__all__ = ["print_results_table"]
