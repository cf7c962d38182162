"""`brats-swap cv` and `brats-swap compare --patch`: resumable, cron-safe cross-validation runs.

Exit codes: 0 = the run is consistent (complete, or stopped by --max-hours at an epoch boundary or by
SIGTERM/SIGUSR1 at a step, and continued by the next invocation); 75 = another process holds the fold (or the
whole run folder), nothing changed;
1 / 2 = bad data / bad config or options that cannot go together, e.g. --status with --submit (one line on
stderr).
"""

from __future__ import annotations

from typing import Annotated

import typer

from brats_swap.cli.common import (
    ConfigOption,
    FoldsOption,
    RunOption,
    SetOption,
    default_run_dir,
    handle_errors,
    resolve_config,
)
from brats_swap.errors import ConfigError
from brats_swap.run.console import line_console, warn
from brats_swap.run.fold_selection import compare_fold_selection, parse_fold_selection
from brats_swap.run.folder import RunFolder

MaxHoursOption = Annotated[
    float | None,
    typer.Option("--max-hours", help="Stop at the epoch boundary that would overrun this many hours; "
                                     "the next invocation continues (exit 0).", show_default=False),
]


# The `cv --submit slurm` options (brats_swap/cv/slurm.py); they only matter with --submit.
SUBMIT_PANEL = "Submitting to a cluster (--submit slurm)"


def _submit_option(*names: str, help: str, **kwargs):  # noqa: A002 - typer's keyword
    return typer.Option(*names, help=help, rich_help_panel=SUBMIT_PANEL, show_default=False, **kwargs)


# `cv` does one of five things; each reads only some options. A given option another mode would read is a
# usage error (exit 2), never silently ignored (e.g. --parallel-folds with --submit) or outranked (--status
# with --submit). The mode options themselves exclude each other.
MODE_OPTIONS = ("status", "summary", "submit", "nproc")
_SUBMIT_KNOBS = frozenset({"partition", "time_limit", "gpus_per_fold", "cpus_per_fold", "mem", "account", "qos",
                           "grace", "sbatch_arg", "dry_run", "summary_partition", "summary_time"})
_RUN = frozenset({"config", "set_", "run"})
MODE_READS: dict[str, frozenset[str]] = {
    "status": frozenset({"run"}),
    "summary": _RUN,
    "submit": _RUN | _SUBMIT_KNOBS,
    "nproc": _RUN | {"folds", "max_hours"},
    "train": _RUN | {"folds", "max_hours", "parallel_folds"},
}


def check_option_combination(ctx: typer.Context) -> str:
    """The mode the given options select (one of `MODE_OPTIONS`, else "train"); ConfigError (exit 2), one line,
    for two modes at once or an option the mode does not read."""
    sources = {param.name: ctx.get_parameter_source(param.name) for param in ctx.command.params}
    # Typer's click keeps ParameterSource private; its member names are the interface.
    given = [param for param in ctx.command.params
             if sources[param.name] is not None and sources[param.name].name not in ("DEFAULT", "DEFAULT_MAP")]
    spelled = {param.name: param.opts[0] for param in given}
    modes = [name for name in MODE_OPTIONS if name in spelled]
    if len(modes) > 1:
        raise ConfigError(f"cv: {spelled[modes[0]]} and {spelled[modes[1]]} cannot go together; choose one")
    mode = modes[0] if modes else "train"
    for name, option in spelled.items():
        if name != mode and name not in MODE_READS[mode]:
            doing = f"with {spelled[mode]}" if modes else "without --submit"
            raise ConfigError(f"cv: {option} does not apply {doing}; {_MODE_READS_TEXT[mode]}")
    return mode


_MODE_READS_TEXT = {
    "status": "--status reads the run folder alone (give only --run)",
    "summary": "--summary trains nothing (give --config/--set/--run only)",
    "submit": "the job scripts run every unfinished fold as its own task (size them with the submit options)",
    "nproc": "--nproc trains one fold at a time on all ranks (no --parallel-folds)",
    "train": "the submit options size the SLURM jobs of --submit slurm",
}


@handle_errors
def cv(
    ctx: typer.Context,
    config: ConfigOption = None,
    set_: SetOption = None,
    run: RunOption = None,
    folds: FoldsOption = "all",
    max_hours: MaxHoursOption = None,
    parallel_folds: Annotated[int, typer.Option("--parallel-folds", help="Train this many folds at once, one "
                                                "worker process per GPU (or per CPU share).")] = 1,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Train each fold with N processes on this node "
                                              "(torchrun + DDP).", show_default=False)] = None,
    status: Annotated[bool, typer.Option("--status", help="Print each fold's state (done, running on which job, "
                                         "epoch/step, last checkpoint) and exit.")] = False,
    summary: Annotated[bool, typer.Option("--summary", help="Train nothing: write cv_summary.* (and "
                                          "postprocessing.json once every fold is done) from the folds as they are."
                                          )] = False,
    submit: Annotated[str | None, _submit_option("--submit", help="'slurm': write RUN/slurm/cv.sbatch (one array "
                                                 "task per unfinished fold) and summary.sbatch, and sbatch them.")] = None,
    partition: Annotated[str | None, _submit_option("--partition", help="SLURM partition of the fold tasks.")] = None,
    time_limit: Annotated[str | None, _submit_option("--time", help="Time limit per fold task, e.g. 24:00:00.")] = None,
    gpus_per_fold: Annotated[int | None, _submit_option("--gpus-per-fold", help="GPUs per fold task (default 1, "
                                                        "0 when train.device is cpu); N > 1 runs under torchrun.")] = None,
    cpus_per_fold: Annotated[int | None, _submit_option("--cpus-per-fold", help="CPUs per fold task (default: "
                                                        "data.loader_workers + train.threads, else 1, per GPU).")] = None,
    mem: Annotated[str | None, _submit_option("--mem", help="Memory per fold task, e.g. 64G (default: from the "
                                              "config and the plan, as the script's comment says).")] = None,
    account: Annotated[str | None, _submit_option("--account", help="SLURM account.")] = None,
    qos: Annotated[str | None, _submit_option("--qos", help="SLURM quality of service.")] = None,
    grace: Annotated[int, _submit_option("--grace", help="Seconds of warning (SIGUSR1) before the time limit: "
                                         "the fold checkpoints and requeues itself (default 600).")] = 600,
    sbatch_arg: Annotated[list[str] | None, _submit_option("--sbatch-arg", help="Extra #SBATCH line, passed "
                                                           "through (repeatable), e.g. --sbatch-arg=--exclusive.")] = None,
    dry_run: Annotated[bool, _submit_option("--dry-run", help="With --submit: write and print the scripts, "
                                            "submit nothing.")] = False,
    summary_partition: Annotated[str | None, _submit_option("--summary-partition", help="SLURM partition of the "
                                                            "summary job, which needs no GPU (default: the "
                                                            "cluster's default partition).")] = None,
    summary_time: Annotated[str | None, _submit_option("--summary-time", help="Time limit of the summary job "
                                                       "(default one hour).")] = None,
) -> None:
    """Train and evaluate the folds of a cross-validation run, continuing where the last call stopped.

    Safe under cron and on a cluster: each fold has its own lock (a second call on the same fold exits 75;
    other folds run at once, also on other machines sharing the run folder); --max-hours stops at an epoch
    boundary, SIGTERM/SIGUSR1 at the next step, with the checkpoint written (exit 0). With --run and no
    --config, the run's own config.yaml is used (a --set is recorded there). Writes cv_summary.{json,md},
    figures/ and one line per call in cv.log. Under torchrun every fold trains on all ranks.
    """
    from brats_swap.cv import run_cv

    check_option_combination(ctx)
    if status:
        return _print_status(run)
    resolved, run_dir = _run_and_config(config, set_, run)
    if submit is not None:
        from brats_swap.cv.slurm import SlurmOptions

        options = SlurmOptions(partition=partition, time=time_limit, gpus_per_fold=gpus_per_fold,
                               cpus_per_fold=cpus_per_fold, mem=mem, account=account, qos=qos,
                               summary_partition=summary_partition, summary_time=summary_time, grace=grace,
                               sbatch_args=list(sbatch_arg or []))
        return _submit(submit, resolved, run_dir, options, dry_run)
    if summary:
        from brats_swap.cv.runner import summarise_run

        outcome = summarise_run(resolved, run_dir, console=line_console)
    elif nproc is not None:
        import sys

        from brats_swap.distributed import launch_torchrun
        from brats_swap.train.data import prepare_run_data

        prepare_run_data(resolved.data)  # here, before torchrun starts the ranks that read the cache
        raise typer.Exit(launch_torchrun(nproc, sys.argv[1:]))
    else:
        outcome = run_cv(resolved, run_dir, folds=parse_fold_selection(folds), max_hours=max_hours,
                         parallel_folds=parallel_folds, console=line_console)
    _report(outcome, run_dir)


def _report(outcome, run_dir) -> None:
    """What the call did, and its exit code (module docstring)."""
    if outcome is None:  # torchrun ranks > 0 followed rank 0's folds; rank 0 reports
        return
    _say(f"{run_dir}: {outcome.describe()} ({outcome.seconds:.0f} s)")
    if outcome.complete:
        _say(f"summary: {RunFolder(run_dir).cv_summary_md}")
    raise typer.Exit(outcome.exit_code)


def _say(text: str) -> None:
    line_console.print(text)


def _run_and_config(config, set_, run):
    """The run folder and its config: `--run R` without `--config` uses R/config.yaml (cv/run_config.py)."""
    from brats_swap.cv.run_config import run_config

    if run is None:
        run = default_run_dir(resolve_config(config, set_), None)
    return run_config(run, config, set_, say=_say), run


def _print_status(run) -> None:
    from brats_swap.cv.status_report import run_status

    if run is None:
        raise ConfigError("--status: name the run folder with --run")
    for fold_status in run_status(run):
        _say(fold_status.line())


def _submit(scheduler: str, config, run_dir, options, dry_run: bool) -> None:
    """`--submit slurm`: record the run's config (the jobs read it), write the scripts, submit them."""
    from brats_swap.atomic import atomic_write_text
    from brats_swap.config import config_to_yaml
    from brats_swap.cv.slurm import ARRAY_PLACEHOLDER, submit_cv

    if scheduler != "slurm":
        raise ConfigError(f"--submit {scheduler!r}: the only scheduler is 'slurm'")
    run = RunFolder(run_dir)
    if not run.config.is_file():
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config, config_to_yaml(config))
    submission = submit_cv(config, run, options, dry_run=dry_run)
    if dry_run:
        for script in (submission.cv_script, submission.summary_script):
            _say(f"# {script}\n{script.read_text(encoding='utf-8')}")
        _say(f"--dry-run: nothing submitted; to submit: sbatch {submission.cv_script}, then put its job id in place of "
             f"{ARRAY_PLACEHOLDER} in {submission.summary_script} and sbatch that")
        return
    _say(f"submitted folds {', '.join(map(str, submission.folds))} as array job {submission.array_job} "
         f"({submission.cv_script}) and the summary as job {submission.summary_job} ({submission.summary_script})")
    _say(f"follow them with: squeue -j {submission.array_job},{submission.summary_job}   or   "
         f"brats-swap cv --status --run {run_dir}")


@handle_errors
def compare(
    patch: Annotated[bool, typer.Option("--patch", help="Whole volumes vs train.patch patches (the paper's "
                                                        "comparison).")] = False,
    config: ConfigOption = None,
    set_: SetOption = None,
    run: RunOption = None,
    folds: Annotated[str, typer.Option("--folds", "--fold", "-f", help="Folds: all, folds K,K (a single fold: "
                                       "K,); a bare number K still means the first K folds, with a notice (next "
                                       "release: fold K, as in cv).")] = "all",
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
    selection, notice = compare_fold_selection(folds)
    if notice is not None:
        warn(notice)
    outcome = run_compare(resolved, run_dir, folds=selection, max_hours=max_hours, console=line_console)
    _say(f"{run_dir}: {outcome.describe()} ({outcome.seconds:.0f} s)")
    _say(f"comparison: {RunFolder(run_dir).compare_md}")
    raise typer.Exit(0)
