"""The one progress-bar layout used by long work (prepare, synth, train epochs, evaluation)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(description: str = "{task.description}", *extra_columns: ProgressColumn,
                 console: Console | None = None, transient: bool = False, disable: bool = False) -> Progress:
    """description | bar | done/total | elapsed | remaining | extra columns."""
    return Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), *extra_columns, console=console, transient=transient, disable=disable)
