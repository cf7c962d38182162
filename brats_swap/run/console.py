"""The stderr console of long-running work (progress bars, warnings), so stdout stays clean for tables and piping."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True, highlight=False)


def warn(message: str) -> None:
    """One `warning:` line on stderr; the message is printed as given, wrapped softly."""
    console.print(f"[bold yellow]warning:[/] {message}", markup=True, highlight=False, soft_wrap=True)
