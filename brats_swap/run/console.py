"""The consoles of long-running work and of the commands' result lines, with their options set once.

Both print text exactly as given: no markup, no highlighting, never wrapped or cropped, so a path, a case
id or a command stays whole and copyable (a message that is markup says so: `markup=True`). `console` is
stderr (progress bars, warnings, status lines), so stdout stays clean for tables and piping; `line_console`
is stdout, for the commands' result lines. Tables (which wrap their titles and cells to the terminal) go to
`brats_swap.cli.common.console`.
"""

from __future__ import annotations

from rich.console import Console


def plain_console(*, stderr: bool) -> Console:
    return Console(stderr=stderr, markup=False, highlight=False, soft_wrap=True)


console = plain_console(stderr=True)
line_console = plain_console(stderr=False)


def warn(message: str) -> None:
    """One `warning:` line on stderr; the message is printed as given, wrapped softly."""
    console.print(f"[bold yellow]warning:[/] {message}", markup=True)
