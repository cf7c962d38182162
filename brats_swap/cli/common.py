"""Shared pieces of the thin CLI layer: options, config resolution, and error -> exit-code mapping."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from brats_swap.config import Config, load_config
from brats_swap.errors import EXIT_INTERRUPTED, BratsSwapError

console = Console(stderr=False)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)

# Set by the top-level --debug option: show tracebacks instead of one-line errors.
DEBUG = {"enabled": False}

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config file (see configs/).", show_default=False)
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.lr=1e-3 (repeatable).",
                 show_default=False),
]
RunOption = Annotated[
    Path | None, typer.Option("--run", help="Run folder (default: runs/<config name>).", show_default=False)
]

F = TypeVar("F", bound=Callable[..., Any])


def resolve_config(config: Path | None, overrides: list[str] | None) -> Config:
    return load_config(config, overrides or [])


def default_run_dir(config: Config, run: Path | None) -> Path:
    return run if run is not None else Path("runs") / config.name


def fail(message: str, exit_code: int) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    return typer.Exit(exit_code)


def handle_errors(func: F) -> F:
    """Turn the project's errors into one line on stderr and the documented exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except BratsSwapError as exc:
            if DEBUG["enabled"]:
                traceback.print_exc(file=sys.stderr)
            raise fail(_one_line(str(exc)), exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "unknown error"
