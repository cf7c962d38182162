"""Shared pieces of the thin CLI layer: options, config resolution, and error -> exit-code mapping."""

from __future__ import annotations

import functools
import inspect
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup, TyperOption

from brats_swap.atomic import DISK_PROBLEMS
from brats_swap.config import Config, load_config
from brats_swap.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OUT_OF_MEMORY,
    BratsSwapError,
    PlannedStop,
    user_message,
)
from brats_swap.run.console import console as stderr_console
from brats_swap.run.console import warn
from brats_swap.run.folder import RunFolder

console = Console(stderr=False, highlight=False)  # tables and panels; lines go to run.console's consoles
err_console = stderr_console

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

FoldsOption = Annotated[
    str, typer.Option("--folds", "--fold", "-f", help="Folds: all, a fold K, or folds K,K (--fold is the same "
                                                      "option).")
]
CheckpointOption = Annotated[str, typer.Option("--checkpoint", help="best, latest, or a checkpoint file.")]
RuntimeOption = Annotated[str, typer.Option("--runtime", help="What runs a bundle's networks: torch, or onnxruntime "
                                            "(its ONNX networks from export --onnx; imports no torch).")]

F = TypeVar("F", bound=Callable[..., Any])


def flag(names: str, help: str) -> Any:
    """A boolean option spelled `--x/--no-x` (`--tta true` is refused); its help shows no value
    (`HonestHelpGroup`)."""
    return typer.Option(names, help=help)


def _joined_lines(text: str | None) -> str | None:
    """A docstring's paragraphs each on one line (the help's console wraps them to its width; the source's own
    wraps would break them again), keeping lines that start a list item or are indented (examples)."""
    if not text:
        return text
    return re.sub(r"(?<=\S)\n(?=[^\s\-*])", " ", inspect.cleandoc(text))


def _honest_help(command: Any) -> None:  # a Typer (click) command or group
    """Make `command`'s help (and its subcommands') say what it takes: a flag (no value; also --help) gets no
    `<bool>` type, an option of several values (nargs > 1) the spelling it reads (`<int> <int> <int>`, not
    `<int,int,int>...`), and the text its own line wraps only."""
    command.help = _joined_lines(command.help)
    help_option = command.get_help_option(typer.Context(command))
    for param in [*command.params, *([help_option] if help_option is not None else [])]:
        if not isinstance(param, TyperOption) or param.metavar is not None:
            continue
        if param.is_flag:
            param.metavar = ""
        elif param.nargs > 1:
            param.metavar = " ".join(f"<{part}>" for part in param.display_type(None).strip("<>").split(","))
    for sub in getattr(command, "commands", {}).values():
        _honest_help(sub)


class HonestHelpGroup(TyperGroup):
    """The top-level command group: every command's --help made honest once, when the app is built (Typer
    shows a `<bool>` value for flags and a comma-joined type for options of several values)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _honest_help(self)


def resolve_config(config: Path | None, overrides: list[str] | None, data_root: Path | None = None) -> Config:
    """The config of a command; `data.modalities`, unless set, the images of the challenge of the data
    (`data_root`, default `data.root`)."""
    from brats_swap.data.discovery import challenge_images

    return load_config(config, overrides or [], warn=warn,
                       images_of=lambda data: challenge_images(data_root or data.root, data.challenge))


def default_run_dir(config: Config, run: Path | None) -> Path:
    """`--run` if given, else the run folder named after the config (`runs/<config name>`)."""
    return run if run is not None else RunFolder.default_for(config.name).root


def run_and_config(config: Path | None, overrides: list[str] | None, run: Path | None,
                   say: Callable[[str], None]) -> tuple[Config, Path]:
    """The config and run folder of a command that writes into a run (`train`, `cv`, `evaluate --run`): `--run`
    or runs/<config name>. An existing run's config.yaml is the base without `--config`, and what the call
    changes is recorded there (and said) or refused: one rule, brats_swap/cv/run_config.py."""
    from brats_swap.cv.run_config import run_config

    if run is None:
        run = default_run_dir(resolve_config(config, overrides), None)
    return run_config(run, config, overrides, say=say, load=resolve_config), run


def fail(message: str, exit_code: int) -> typer.Exit:
    # The message is plain text: escape it, or rich would swallow e.g. "[low, high]" as a markup tag.
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    return typer.Exit(exit_code)


def handle_errors(func: F) -> F:
    """Turn the project's errors into one line on stderr and the documented exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PlannedStop as exc:  # documented and asked for: said as what it is, with its exit code
            err_console.print(f"[bold yellow]stopped:[/] {escape(_one_line(user_message(exc)))}", markup=True)
            raise typer.Exit(exc.exit_code) from None
        except BratsSwapError as exc:
            if DEBUG["enabled"]:
                traceback.print_exc(file=sys.stderr)
            raise fail(_one_line(user_message(exc)), exc.exit_code) from None
        except KeyboardInterrupt:
            if DEBUG["enabled"]:
                traceback.print_exc(file=sys.stderr)
            raise fail("interrupted", EXIT_INTERRUPTED) from None
        except MemoryError as exc:
            # The safety net for out-of-memory errors no command turned into DeviceOutOfMemoryError itself
            # (training does, with the planner's advice): still one line and exit 3, not a traceback.
            if DEBUG["enabled"]:
                traceback.print_exc(file=sys.stderr)
            raise fail(f"{func.__name__}: the host ran out of memory ({_first_line(exc) or 'MemoryError'}); "
                       "try a smaller data.cube, fewer data.loader_workers or memory.mode=none",
                       EXIT_OUT_OF_MEMORY) from None
        except OSError as exc:
            # Writes that do not go through brats_swap.atomic (logs, TensorBoard events) on a full disk.
            problem = DISK_PROBLEMS.get(exc.errno)
            if problem is None:
                raise
            if DEBUG["enabled"]:
                traceback.print_exc(file=sys.stderr)
            where = exc.filename if exc.filename is not None else func.__name__
            raise fail(f"{where}: {problem}", EXIT_BAD_INPUT) from None
        except Exception as exc:
            if not _is_device_oom(exc):
                raise
            if DEBUG["enabled"]:
                traceback.print_exc(file=sys.stderr)
            raise fail(f"{func.__name__}: the device ran out of memory ({_first_line(exc)}); try --set "
                       "memory.mode=auto --set memory.budget_gib=<GiB> (the planner picks what to swap or "
                       "recompute), or a smaller data.cube / train.patch / evaluate.sw_batch_size",
                       EXIT_OUT_OF_MEMORY) from None

    return wrapper  # type: ignore[return-value]


def _is_device_oom(exc: BaseException) -> bool:
    # torch is imported lazily by the commands; if it is not loaded, this cannot be its error.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "unknown error"
