"""`brats-swap cv run | status | summary | submit` and `brats-swap compare --patch`: resumable, cron-safe
cross-validation runs.

- `cv run`: train and evaluate the folds, continuing where the last call stopped (`--parallel-folds N`,
  `--nproc N` for torchrun);
- `cv status`: each fold's state, from the run folder alone;
- `cv summary`: train nothing; write cv_summary.* (and postprocessing.json once every fold is done);
- `cv submit [slurm]`: write the SLURM job scripts of the unfinished folds and the summary, and sbatch them.

The spellings before the subcommands (`cv --status`, `cv --summary`, `cv --submit slurm`, a plain `cv ...`)
keep working for this release through `cv_options`, with a one-line notice on stderr naming the new
spelling: `CVCommands` routes a `cv` call without a subcommand there.

Exit codes: 0 = the run is consistent (complete, or stopped by --max-hours at an epoch boundary or by
SIGTERM/SIGUSR1 at a step, and continued by the next invocation); 75 = another process holds the fold (or the
whole run folder), nothing changed;
1 / 2 = bad data / bad config or options that cannot go together, e.g. --status with --submit (one line on
stderr); 130 = Ctrl-C, the state saved at the end of the step (the same command continues).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from brats_swap.cli.common import (
    ConfigOption,
    FoldsOption,
    RunOption,
    SetOption,
    console,
    handle_errors,
    resolve_config,
    run_and_config,
)
from brats_swap.errors import ConfigError, TrainingInterrupted
from brats_swap.run.console import line_console, warn
from brats_swap.run.fold_selection import compare_fold_selection, parse_fold_selection
from brats_swap.run.folder import RunFolder

MaxHoursOption = Annotated[
    float | None,
    typer.Option("--max-hours", help="Stop at the epoch boundary that would overrun this many hours; "
                                     "the next invocation continues (exit 0).", show_default=False),
]
ParallelFoldsOption = Annotated[int, typer.Option("--parallel-folds", help="Train this many folds at once, one "
                                                  "worker process per GPU (or per CPU share).")]
NprocOption = Annotated[int | None, typer.Option("--nproc", help="Train each fold with N processes on this node "
                                                 "(torchrun + DDP).", show_default=False)]


# The `cv submit slurm` options (brats_swap/cv/slurm.py).
SUBMIT_PANEL = "Submitting to a cluster (cv submit slurm)"


def _submit_option(*names: str, help: str, **kwargs):  # noqa: A002 - typer's keyword
    return typer.Option(*names, help=help, rich_help_panel=SUBMIT_PANEL, show_default=False, **kwargs)


PartitionOption = Annotated[str | None, _submit_option("--partition", help="SLURM partition of the fold tasks.")]
TimeOption = Annotated[str | None, _submit_option("--time", help="Time limit per fold task, e.g. 24:00:00.")]
GpusOption = Annotated[int | None, _submit_option("--gpus-per-fold", help="GPUs per fold task (default 1, 0 when "
                                                  "train.device is cpu); N > 1 runs under torchrun.")]
CpusOption = Annotated[int | None, _submit_option("--cpus-per-fold", help="CPUs per fold task (default: "
                                                  "data.loader_workers + train.threads, else 1, per GPU).")]
MemOption = Annotated[str | None, _submit_option("--mem", help="Memory per fold task, e.g. 64G (default: from the "
                                                 "config and the plan, as the script's comment says).")]
AccountOption = Annotated[str | None, _submit_option("--account", help="SLURM account.")]
QosOption = Annotated[str | None, _submit_option("--qos", help="SLURM quality of service.")]
GraceOption = Annotated[int, _submit_option("--grace", help="Seconds of warning (SIGUSR1) before the time limit: "
                                            "the fold checkpoints and requeues itself (default 600).")]
SbatchArgOption = Annotated[list[str] | None, _submit_option("--sbatch-arg", help="Extra #SBATCH line, passed "
                                                             "through (repeatable), e.g. --sbatch-arg=--exclusive.")]
DryRunOption = Annotated[bool, _submit_option("--dry-run", help="Write and print the scripts, submit nothing.")]
SummaryPartitionOption = Annotated[str | None, _submit_option("--summary-partition", help="SLURM partition of the "
                                                              "summary job, which needs no GPU (default: the "
                                                              "cluster's default partition).")]
SummaryTimeOption = Annotated[str | None, _submit_option("--summary-time", help="Time limit of the summary job "
                                                         "(default one hour).")]


class CVCommands(TyperGroup):
    """`cv`'s subcommands; a call that starts with an option instead (`cv --status`, `cv --config X`) or has
    no argument goes to the hidden `cv_options` command, which reads the spellings from before the
    subcommands. (`cv` never took a positional argument, so `cv bogus` stays an unknown command.)"""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args or (args[0].startswith("-") and args[0] not in ctx.help_option_names):
            args = [OLD_SPELLINGS_COMMAND, *args]
        return super().parse_args(ctx, args)

    def get_command(self, ctx, cmd_name: str):
        if cmd_name == OLD_SPELLINGS_COMMAND:
            return self.old_spellings()
        return super().get_command(ctx, cmd_name)

    def old_spellings(self) -> TyperCommand:
        """The hidden command of the old spellings, from the options of `cv run` and `cv submit` (one
        declaration of each) and the old mode flags."""
        options: dict[str, typer.core.TyperOption] = {}
        for command in (self.commands["run"], self.commands["submit"], typer.main.get_command(_old_mode_flags)):
            for param in command.params:
                if isinstance(param, typer.core.TyperOption):
                    options.setdefault(param.name, param)
        return _OldSpellings(OLD_SPELLINGS_COMMAND, params=list(options.values()), hidden=True,
                             help="`cv` as spelled before the subcommands (this release only).")


OLD_SPELLINGS_COMMAND = "options"
app = typer.Typer(cls=CVCommands, name="cv", add_completion=False,
                  help="Cross-validation runs, resumable and safe under cron and on a cluster: cv run | status | "
                       "summary | submit.")


@app.command("run")
@handle_errors
def cv_run(
    config: ConfigOption = None,
    set_: SetOption = None,
    run: RunOption = None,
    folds: FoldsOption = "all",
    max_hours: MaxHoursOption = None,
    parallel_folds: ParallelFoldsOption = 1,
    nproc: NprocOption = None,
) -> None:
    """Train and evaluate the folds of a cross-validation run, continuing where the last call stopped.

    Each fold has its own lock (a second call on the same fold exits 75; other folds run at once, also on
    other machines sharing the run folder); --max-hours stops at an epoch boundary, SIGTERM/SIGUSR1 at the
    next step, with the checkpoint written (exit 0). With --run and no --config, the run's own config.yaml
    is used (a --set is recorded there). Writes cv_summary.{json,md}, figures/ and one line per call in
    cv.log. Under torchrun every fold trains on all ranks.
    """
    if nproc is not None and parallel_folds != 1:
        raise ConfigError(f"cv run: --parallel-folds does not apply with --nproc; {_MODE_READS_TEXT['nproc']}")
    _train(config, set_, run, folds, max_hours, parallel_folds, nproc, sys.argv[1:])


@app.command("status")
@handle_errors
def cv_status(run: RunOption = None) -> None:
    """Print each fold's state (done, running on which job, epoch/step, last checkpoint) and exit."""
    _print_status(run, "cv status")


@app.command("summary")
@handle_errors
def cv_summary(config: ConfigOption = None, set_: SetOption = None, run: RunOption = None) -> None:
    """Train nothing: write cv_summary.* (and postprocessing.json once every fold is done) from the folds as
    they are, e.g. in the job that follows a SLURM array."""
    _summarise(config, set_, run)


@app.command("submit")
@handle_errors
def cv_submit(
    scheduler: Annotated[str, typer.Argument(help="The scheduler: slurm (the only one).")] = "slurm",
    config: ConfigOption = None,
    set_: SetOption = None,
    run: RunOption = None,
    partition: PartitionOption = None,
    time_limit: TimeOption = None,
    gpus_per_fold: GpusOption = None,
    cpus_per_fold: CpusOption = None,
    mem: MemOption = None,
    account: AccountOption = None,
    qos: QosOption = None,
    grace: GraceOption = 600,
    sbatch_arg: SbatchArgOption = None,
    dry_run: DryRunOption = False,
    summary_partition: SummaryPartitionOption = None,
    summary_time: SummaryTimeOption = None,
) -> None:
    """Write RUN/slurm/cv.sbatch (one array task per unfinished fold) and summary.sbatch, and sbatch them."""
    _submit(scheduler, config, set_, run, _slurm_options(locals()), dry_run)


# `cv` without a subcommand, as before them, does one of five things; each reads only some options. A given
# option another mode would read is a usage error (exit 2), never silently ignored (e.g. --parallel-folds with
# --submit) or outranked (--status with --submit). The mode options themselves exclude each other.
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
# What each mode is called now (the notice that an old spelling prints names it).
NEW_SPELLING = {"status": ("--status", "cv status"), "summary": ("--summary", "cv summary"),
                "submit": ("--submit slurm", "cv submit slurm"), "nproc": ("--nproc N", "cv run --nproc N"),
                "train": ("without a subcommand", "cv run")}


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


# The options only the old spellings have; `CVCommands.old_spellings` adds those of `cv run` and `cv submit`.
_old_mode_flags = typer.Typer()


@_old_mode_flags.command()
def _old_mode_options(
    status: Annotated[bool, typer.Option("--status", help="Now `cv status`.")] = False,
    summary: Annotated[bool, typer.Option("--summary", help="Now `cv summary`.")] = False,
    submit: Annotated[str | None, _submit_option("--submit", help="Now `cv submit slurm`.")] = None,
) -> None:
    """Never run: its options are read by `CVCommands.old_spellings`."""


class _OldSpellings(TyperCommand):
    """`cv` as spelled before the subcommands: the options of `cv run`, `cv submit` and the mode flags."""

    def invoke(self, ctx):
        return cv_options(ctx, **ctx.params)


@handle_errors
def cv_options(ctx: typer.Context, *, status: bool, summary: bool, submit: str | None, **given) -> None:
    """`cv` as it was spelled before the subcommands (this release only): the options choose the mode."""
    mode = check_option_combination(ctx)
    old, new = NEW_SPELLING[mode]
    warn(f"`brats-swap cv {old}` is now `brats-swap {new}`; the old spelling works until the next release")
    # Typer converts a command's values when it builds the callback; this command is built by hand.
    config, run = (None if given[key] is None else Path(given[key]) for key in ("config", "run"))
    set_ = list(given["set_"] or [])
    if status:
        return _print_status(run, "--status")
    if submit is not None:
        return _submit(submit, config, set_, run, _slurm_options(given), given["dry_run"])
    if summary:
        return _summarise(config, set_, run)
    _train(config, set_, run, given["folds"], given["max_hours"], given["parallel_folds"], given["nproc"],
           _with_run_subcommand(sys.argv[1:]))


def _with_run_subcommand(argv: list[str]) -> list[str]:
    """The command line of `cv --nproc N ...` as `cv run --nproc N ...`, for the ranks torchrun starts."""
    if "cv" not in argv:
        return argv
    at = argv.index("cv") + 1
    return [*argv[:at], "run", *argv[at:]]


def _train(config, set_, run, folds, max_hours, parallel_folds: int, nproc: int | None, argv: list[str]) -> None:
    resolved, run_dir = run_and_config(config, set_, run, _say)
    from brats_swap.cv import run_cv  # the training stack only once the config is sound

    if nproc is not None:
        from brats_swap.distributed import launch_torchrun
        from brats_swap.train.data import prepare_run_data

        prepare_run_data(resolved.data)  # here, before torchrun starts the ranks that read the cache
        raise typer.Exit(launch_torchrun(nproc, argv))
    try:
        outcome = run_cv(resolved, run_dir, folds=parse_fold_selection(folds), max_hours=max_hours,
                         parallel_folds=parallel_folds, console=line_console)
    except TrainingInterrupted as exc:  # Ctrl-C in a step, the state saved at its end
        raise TrainingInterrupted(f"{exc}; run the same command again to continue") from None
    _report(outcome, run_dir)


def _summarise(config, set_, run) -> None:
    resolved, run_dir = run_and_config(config, set_, run, _say)
    from brats_swap.cv.runner import summarise_run

    _report(summarise_run(resolved, run_dir, console=line_console), run_dir)


def _slurm_options(given: dict):
    """The `SlurmOptions` of the submit options among a command's arguments (`locals()`)."""
    from brats_swap.cv.slurm import SlurmOptions

    return SlurmOptions(partition=given["partition"], time=given["time_limit"], gpus_per_fold=given["gpus_per_fold"],
                        cpus_per_fold=given["cpus_per_fold"], mem=given["mem"], account=given["account"],
                        qos=given["qos"], summary_partition=given["summary_partition"],
                        summary_time=given["summary_time"], grace=given["grace"],
                        sbatch_args=list(given["sbatch_arg"] or []))


def _report(outcome, run_dir) -> None:
    """What the call did, and its exit code (module docstring)."""
    if outcome is None:  # torchrun ranks > 0 followed rank 0's folds; rank 0 reports
        return
    from brats_swap.cv.summary import print_cv_table

    _say(f"{run_dir}: {outcome.describe()} ({outcome.seconds:.0f} s)")
    if print_cv_table(run_dir, console) or outcome.complete:  # the numbers, then where they are
        _say(f"summary: {RunFolder(run_dir).cv_summary_md}")
    raise typer.Exit(outcome.exit_code)


def _say(text: str) -> None:
    line_console.print(text)


def _print_status(run, spelled: str) -> None:
    from brats_swap.cv.status_report import run_status

    if run is None:
        raise ConfigError(f"{spelled}: name the run folder with --run")
    for fold_status in run_status(run):
        _say(fold_status.line())


def _submit(scheduler: str, config, set_, run, options, dry_run: bool) -> None:
    """`cv submit slurm`: record the run's config (the jobs read it), write the scripts, submit them."""
    from brats_swap.atomic import atomic_write_text
    from brats_swap.config import config_to_yaml
    from brats_swap.cv.slurm import ARRAY_PLACEHOLDER, check_paths, submit_cv

    config, run_dir = run_and_config(config, set_, run, _say)
    if scheduler != "slurm":
        raise ConfigError(f"cv submit {scheduler!r}: the only scheduler is 'slurm'")
    run = RunFolder(run_dir)
    check_paths(run)  # a folder the #SBATCH lines cannot carry is refused before anything is written
    if not run.config.is_file():
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config, config_to_yaml(config))
    submission = submit_cv(config, run, options, dry_run=dry_run)
    if dry_run:
        for script in (submission.cv_script, submission.summary_script):
            _say(f"# {script}\n{script.read_text(encoding='utf-8')}")
        # Commands to paste into a shell: their paths quoted (a run folder may hold a space or a quote).
        _say(f"--dry-run: nothing submitted; to submit: sbatch {shlex.quote(str(submission.cv_script))}, then put "
             f"its job id in place of {ARRAY_PLACEHOLDER} in {shlex.quote(str(submission.summary_script))} and "
             "sbatch that")
        return
    _say(f"submitted folds {', '.join(map(str, submission.folds))} as array job {submission.array_job} "
         f"({submission.cv_script}) and the summary as job {submission.summary_job} ({submission.summary_script})")
    _say(f"follow them with: squeue -j {submission.array_job},{submission.summary_job}   or   "
         f"brats-swap cv status --run {shlex.quote(str(run_dir))}")


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
    Resumable and locked like `brats-swap cv run`.
    """
    if not patch:
        raise ConfigError("compare: choose what to compare; the only comparison is --patch (whole volume vs patches)")
    resolved = resolve_config(config, set_)
    from brats_swap.cv.compare import run_compare  # the training stack only once the config is sound

    # Not runs/<name>: that is where `brats-swap cv run` / `train` put the same config's plain run.
    run_dir = run if run is not None else RunFolder.default_for(f"{resolved.name}-compare").root
    selection, notice = compare_fold_selection(folds)
    if notice is not None:
        warn(notice)
    outcome = run_compare(resolved, run_dir, folds=selection, max_hours=max_hours, console=line_console)
    _say(f"{run_dir}: {outcome.describe()} ({outcome.seconds:.0f} s)")
    from brats_swap.cv.comparison import print_comparison

    print_comparison(outcome.comparison, line_console)  # the numbers, then where the report is
    _say(f"comparison: {RunFolder(run_dir).compare_md}")
    raise typer.Exit(0)
