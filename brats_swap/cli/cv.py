"""`brats-swap cv` and `brats-swap compare --patch`: resumable, cron-safe cross-validation runs.

Exit codes: 0 = the run is consistent (complete, or stopped by --max-hours / SIGTERM at an epoch boundary
and continued by the next invocation); 75 = another process holds the run folder's lock, nothing changed;
1 / 2 = bad data / bad config (one line on stderr).
"""

from __future__ import annotations

from typing import Annotated

import typer

from brats_swap.cli.common import (
    ConfigOption,
    FoldsOption,
    RunOption,
    SetOption,
    console,
    default_run_dir,
    handle_errors,
    resolve_config,
)
from brats_swap.errors import ConfigError
from brats_swap.run.fold_selection import compare_fold_selection, parse_fold_selection
from brats_swap.run.folder import RunFolder

MaxHoursOption = Annotated[
    float | None,
    typer.Option("--max-hours", help="Stop at the epoch boundary that would overrun this many hours; "
                                     "the next invocation continues (exit 0).", show_default=False),
]


@handle_errors
def cv(
    config: ConfigOption = None,
    set_: SetOption = None,
    run: RunOption = None,
    folds: FoldsOption = "all",
    max_hours: MaxHoursOption = None,
    parallel_folds: Annotated[int, typer.Option("--parallel-folds", help="Train this many folds at once, one "
                                                "worker process per GPU (or per CPU share).")] = 1,
) -> None:
    """Train and evaluate the folds of a cross-validation run, continuing where the last call stopped.

    Safe under cron: a second call while one runs exits 75 at once; --max-hours and SIGTERM stop at an
    epoch boundary with the checkpoint written (exit 0). Writes cv_summary.{json,md}, figures/ and one
    line per call in cv.log. Under torchrun every fold trains on all ranks.
    """
    from brats_swap.cv import run_cv

    resolved = resolve_config(config, set_)
    run_dir = default_run_dir(resolved, run)
    outcome = run_cv(resolved, run_dir, folds=parse_fold_selection(folds), max_hours=max_hours,
                     parallel_folds=parallel_folds,
                     console=console)
    if outcome is None:  # torchrun ranks > 0 followed rank 0's folds; rank 0 reports
        return
    console.print(f"{run_dir}: {outcome.describe()} ({outcome.seconds:.0f} s)", markup=False, highlight=False, soft_wrap=True)
    if outcome.complete:
        console.print(f"summary: {RunFolder(run_dir).cv_summary_md}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(outcome.exit_code)


@handle_errors
def compare(
    patch: Annotated[bool, typer.Option("--patch", help="Whole volumes vs train.patch patches (the paper's "
                                                        "comparison).")] = False,
    config: ConfigOption = None,
    set_: SetOption = None,
    run: RunOption = None,
    folds: Annotated[str, typer.Option("--folds", "--fold", "-f", help="Folds: all, folds K,K (a single fold: "
                                       "K,); a bare number K keeps its old meaning, the first K folds.")] = "all",
    max_hours: MaxHoursOption = None,
) -> None:
    """Train and evaluate the same folds twice (whole volume and patches) and compare them.

    Writes RUN/full/ and RUN/patch/ (two cv runs), RUN/compare.md, RUN/compare.json and RUN/figures/*.png.
    Resumable and locked like `brats-swap cv`.
    """
    from brats_swap.cv.compare import run_compare

    if not patch:
        raise ConfigError("compare: choose what to compare; the only comparison is --patch (whole volume vs patches)")
    resolved = resolve_config(config, set_)
    # Not runs/<name>: that is where `brats-swap cv` / `train` put the same config's plain run.
    run_dir = run if run is not None else RunFolder.default_for(f"{resolved.name}-compare").root
    outcome = run_compare(resolved, run_dir, folds=compare_fold_selection(folds), max_hours=max_hours,
                          console=console)
    console.print(f"{run_dir}: {outcome.describe()} ({outcome.seconds:.0f} s)", markup=False, highlight=False, soft_wrap=True)
    console.print(f"comparison: {RunFolder(run_dir).compare_md}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(0)
