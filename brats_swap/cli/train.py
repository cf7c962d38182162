"""`brats-swap train` and `brats-swap evaluate`: thin shells over train/ and evaluate/.

Exit codes: 0 ok (also stopped by SIGTERM/SIGUSR1 with the state saved); 1 bad data / checkpoint / NaN loss; 2 bad config or usage; 3 device out of memory;
130 interrupted (state saved, continue with --resume).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from brats_swap.cli.common import (
    CheckpointOption,
    ConfigOption,
    FoldsOption,
    RunOption,
    SetOption,
    console,
    flag,
    handle_errors,
    run_and_config,
)
from brats_swap.errors import ConfigError, TrainingInterrupted
from brats_swap.run.console import line_console, warn
from brats_swap.run.fold_selection import ALL_FOLDS, parse_fold_selection
from brats_swap.run.folder import RunFolder

FoldOption = Annotated[str | None, typer.Option("--fold", "--folds", "-f", help="The fold of splits.json to "
                                                "train (default 0); the spelling of --folds elsewhere, one fold.",
                                                show_default=False)]


@handle_errors
def train(
    config: ConfigOption = None,
    set_: SetOption = None,
    fold: FoldOption = None,
    run: RunOption = None,
    resume: Annotated[bool, flag("--resume/--no-resume", "Continue from fold_<k>/checkpoint_latest.pt.")] = False,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Train with N processes on this node (torchrun + "
                                              "DDP: one per GPU, or gloo on CPU); batch_size is per process.",
                                              show_default=False)] = None,
) -> None:
    """Train one fold (default fold 0 of cv.folds: the paper's 80/20 split) into the run folder.

    Cases of data.root that data.cache lacks (or holds stale) are prepared first, so this works straight
    from a download. In an existing run folder without --config, the run's own config.yaml is used; a --set or
    a --config that differs from it is recorded there, or refused when it would change what was trained
    (model, data, folds, seed).

    Example: brats-swap train --config configs/quickstart.yaml --set train.max_epochs=5
    """
    fold_k = one_fold(fold)
    if run is not None and resume and not run.is_dir():
        raise ConfigError(f"--run {run}: no run folder {run}; --resume continues an existing run (check the path, "
                          "or leave --resume out to start a new one)")
    # An existing run's config.yaml: a new fold, --resume or not, trains its recipe; a --set is recorded or refused.
    resolved, run_dir = run_and_config(config, set_, run, line_console.print)
    if nproc is not None:
        import sys

        from brats_swap.distributed import launch_torchrun
        from brats_swap.train.data import prepare_run_data

        prepare_run_data(resolved.data)  # here, before torchrun starts the ranks that read the cache
        raise typer.Exit(launch_torchrun(nproc, sys.argv[1:]))
    # The training stack (torch, MONAI, nibabel) only now: a config error above is a quick one-line exit.
    from brats_swap.distributed import is_main_process
    from brats_swap.train.data import prepare_run_data
    from brats_swap.train.loop import train_fold
    from brats_swap.train.summary import summary_panel

    with _fold_lock_of_this_rank(run_dir, fold_k):  # a second train/cv of this fold exits 75 at once
        if _first_process():  # under torchrun the other ranks wait for rank 0 in the process group's set-up
            prepare_run_data(resolved.data)
        try:
            result = train_fold(resolved, run_dir, fold_k, resume=resume)
        except TrainingInterrupted as exc:  # Ctrl-C in a step, the state saved at its end
            raise TrainingInterrupted(f"{exc}; continue with --resume") from None
    if is_main_process():  # under torchrun every rank runs this command; one summary is enough
        console.print(summary_panel(result, resolved))
    if result.stop_reason is not None:  # a scheduler's SIGTERM/SIGUSR1: a planned stop, state saved (exit 0)
        if is_main_process():
            line_console.print(f"{run_dir}: {result.stop_reason}: stopped with the state saved; continue with --resume")
    elif result.interrupted:
        raise TrainingInterrupted(f"{run_dir}: stopped at an epoch boundary; continue with --resume")


def one_fold(selection: str | None) -> int:
    """`train --fold/--folds`: one fold in the one spelling of fold selection (run/fold_selection.py);
    default 0. `all` or several folds is a usage error pointing to `cv`, which trains several."""
    if selection is None:
        return 0
    chosen = parse_fold_selection(selection, option="train --folds")
    if chosen == ALL_FOLDS or len(chosen) != 1:
        raise ConfigError(f"train --folds {selection}: train trains one fold; for several, "
                          f"brats-swap cv run --folds {selection}")
    return chosen[0]


def _first_process() -> bool:
    """A plain process, or rank 0 of a torchrun job."""
    import os

    from brats_swap.distributed import launched_by_torchrun

    return not launched_by_torchrun() or os.environ["RANK"] == "0"


@contextlib.contextmanager
def _fold_lock_of_this_rank(run_dir: Path, fold: int):
    """The fold's lock (brats_swap.cv.lock); under torchrun rank 0 holds it for all ranks. A start that fails
    before any work leaves no folder holding only the lock files (`RunFolder.removed_if_start_fails`)."""
    from brats_swap.cv.lock import fold_work

    if not _first_process():
        yield
        return
    with RunFolder.of(run_dir).removed_if_start_fails(), fold_work(run_dir, [fold]):
        yield


@handle_errors
def evaluate(
    run: Annotated[Path | None, typer.Option("--run", help="Run folder to evaluate.", show_default=False)] = None,
    data: Annotated[Path | None, typer.Option("--data", help="Dataset folder with the ground-truth segmentations "
                                                            "(default: the run's data.root).", show_default=False)] = None,
    folds: FoldsOption = "all",
    checkpoint: CheckpointOption = "best",
    predictions: Annotated[Path | None, typer.Option("--predictions", help="Score <case id>.nii.gz files from any "
                                                                           "tool instead of a run.",
                                                     show_default=False)] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Report folder for --predictions (default: the "
                                                           "predictions folder).", show_default=False)] = None,
    missing: Annotated[str, typer.Option("--missing", help="--predictions: a reference case without a prediction "
                                         "is an error (exit 1, naming them, as the challenge's submission check), or "
                                         "scored as an empty prediction (Dice 0 where there is tumour, the HD95 "
                                         "penalty) and listed.")] = "error",
    edition: Annotated[str, typer.Option("--edition", help="Label table for --predictions: an edition 2017 ... "
                                         "2021, 2023, or a 2023+ challenge (default: each case's own).")] = "auto",
    challenge: Annotated[str, typer.Option("--challenge", help="Force the 2023+ challenge for --predictions: gli, "
                                           "gli-post, met, men, men-rt, ped, ssa, goat.")] = "auto",
    tta: Annotated[bool, flag("--tta/--no-tta", "--run: average the 8 mirrorings of each case (test-time "
                                                "augmentation, as predict --tta).")] = False,
    dataset_labels: Annotated[bool, flag("--dataset-labels/--table-labels", "--predictions for an nnU-Net or "
                                         "Decathlon folder hold its dataset.json's label values (as nnU-Net's "
                                         "own predictions do).")] = False,
    set_: SetOption = None,
) -> None:
    """Score a trained run's validation cases, or any tool's predictions, with the BraTS metrics.

    Writes metrics.csv, summary.json, summary.md and dice_boxplot.png (the 2017-2021 metrics: WT/TC/ET Dice,
    sensitivity, specificity, HD95) and official.csv, official_summary.json (the official 2023+ lesion-wise
    metrics of the challenge's groups); prints both tables. A bad case is listed and skipped, the others are
    scored, and the command exits 1 naming every failed case.

    Examples: brats-swap evaluate --run runs/quickstart;
    brats-swap evaluate --predictions nnunet_out/ --data data/BraTS2021 --out reports/nnunet --missing empty
    """
    from brats_swap.evaluate.failures import CaseFailures

    failures = CaseFailures(say=warn)
    if predictions is not None:
        if run is not None:
            raise ConfigError("evaluate: give either --run or --predictions, not both")
        if tta:
            raise ConfigError("evaluate --tta: only with --run (--predictions scores files that are already made)")
        if data is None:
            raise ConfigError("evaluate --predictions: --data DIR (the dataset with the ground truth) is required")
        _evaluate_predictions(predictions, data, out if out is not None else predictions, edition, challenge,
                              missing, failures, dataset_labels)
        return
    if run is None:
        raise ConfigError("evaluate: give --run DIR (a trained run) or --predictions DIR --data DIR")
    _evaluate_run(RunFolder(run), data, folds, checkpoint, tta, set_, failures)


def _evaluate_predictions(predictions: Path, data: Path, out_dir: Path, edition: str, challenge: str, missing: str,
                          failures, dataset_labels: bool = False) -> None:
    from brats_swap.evaluate.metrics import print_summary
    from brats_swap.evaluate.scoring import evaluate_predictions

    report = evaluate_predictions(predictions, data, out_dir, edition=edition, challenge=challenge, missing=missing,
                                  failures=failures, dataset_labels=dataset_labels)
    if report.summary:
        print_summary(report.summary, console, title=f"{predictions} vs {data}")
        _print_official(out_dir, f"{predictions} vs {data}: official BraTS metrics")
    if report.missing:
        _say(f"scored as empty (no prediction): {', '.join(report.missing)}")
    if report.unmatched:
        _say(f"not scored (no reference case): {', '.join(report.unmatched)}")
    _say(f"report: {out_dir}")
    failures.raise_if_any(f"evaluate {predictions}", report.references)


def _evaluate_run(run_folder: RunFolder, data: Path | None, folds: str, checkpoint: str, tta: bool,
                  set_: list[str] | None, failures) -> None:
    from brats_swap.evaluate.metrics import print_summary
    from brats_swap.evaluate.predicting import select_folds
    from brats_swap.evaluate.scoring import evaluate_fold

    if not run_folder.config.is_file():
        raise ConfigError(f"{run_folder.config}: not found; is {run_folder.root} a brats-swap run folder?")
    resolved, _ = run_and_config(None, set_, run_folder.root, _say)  # a --set recorded (it writes the reports)
    from brats_swap.splits import fold_cases, read_splits

    chosen = select_folds(run_folder, folds, checkpoint)
    for k in chosen:
        summary = evaluate_fold(resolved, run_folder, k, checkpoint=checkpoint, data_root=data, tta=tta,
                                failures=failures)
        title = f"{resolved.name} fold {k} ({checkpoint} checkpoint{', 8-mirror TTA' if tta else ''})"
        if summary:
            print_summary(summary, console, title=title)
            _print_official(run_folder.fold(k).root, f"{title}: official BraTS metrics")
        _say(f"report: {run_folder.fold(k).root}")
    failures.raise_if_any(f"evaluate {run_folder.root} fold(s) {', '.join(map(str, chosen))}",
                          sum(len(fold_cases(read_splits(run_folder.splits), k)[1]) for k in chosen))


def _say(line: str) -> None:
    line_console.print(line)


def _print_official(report_dir: Path, title: str) -> None:
    """The official lesion-wise table of the report just written in `report_dir`."""
    from brats_swap.evaluate.official import print_official_summary, read_official_summary

    official = read_official_summary(report_dir)
    if official is not None:
        groups, summary = official
        print_official_summary(summary, groups, console, title=title)


def register(app: typer.Typer) -> None:
    """Add the two commands to the top-level app (called from cli/main.py)."""
    app.command("train")(train)
    app.command("evaluate")(evaluate)
