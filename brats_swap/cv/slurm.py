"""`brats-swap cv submit slurm`: the folds of a run as a SLURM array job, plus a summary job.

Two plain job scripts are written into `RUN/slurm/` (users read and edit them; re-submitting by hand is
`sbatch RUN/slurm/cv.sbatch`):

- `cv.sbatch`: an array with one task per unfinished fold. Each task runs `brats-swap cv run --config
  RUN/config.yaml --run RUN --fold K` (the run folder remembers its config, `--set`s included), its log is
  `RUN/fold_K/slurm-<array job>_<K>.log` (appended across restarts). SLURM warns the batch shell with SIGUSR1
  `--grace` seconds before the time limit (`--signal=B:USR1@N`); the script passes it on to brats-swap,
  which checkpoints at the next step (mid-epoch) and exits 0, and then requeues its own task
  (`scontrol requeue`, allowed by `--requeue`); the requeued task resumes inside the epoch.
- `summary.sbatch`: after the array (`--dependency=afterany:<array>`), `brats-swap cv summary`: the run's
  cv_summary.* and postprocessing.json from the folds that are done (the task that finishes the last fold
  writes them too; this job makes sure, and reports). It needs no GPU: it asks for none, runs on
  `--summary-partition` (default: the cluster's default partition, not the folds' GPU partition) with a
  short time limit (`--summary-time`, default `SUMMARY_TIME`).

Unless given, each fold task's `--cpus-per-task` and `--mem` follow the config and the plan
(`fold_resources`): per rank a CPU for each of its `data.loader_workers` and its compute threads, and host
memory for each rank's process, its loader workers, the batches they hold ahead and its pinned swap arena.

Folds of one run may train on different nodes at once: each holds its own fold lock (cv/lock.py), so the
run folder must be on a file system shared by the nodes, with working `flock`.

Paths in `#SBATCH` lines (`sbatch_word`, `output_pattern`): sbatch reads those lines itself, not the shell, so
a run folder or working folder with a space, quote or `#` is written in sbatch's own quoting and a `%` of the
run folder as `%%`; what sbatch cannot carry (a newline or control character; a backslash in `--output`) is
refused in one line before anything is written or submitted. The scripts' shell lines quote with
`brats_swap.names.shell_word`.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.atomic import atomic_write_text
from brats_swap.config import Config
from brats_swap.cv.fold_progress import fold_standing
from brats_swap.errors import ConfigError, DataError
from brats_swap.names import checked_name, script_text, shell_word
from brats_swap.run.folder import RunFolder
from brats_swap.splits import read_splits
from brats_swap.train.planning import GIB, arena_bound_bytes, host_memory

SLURM_FOLDER = "slurm"
ARRAY_PLACEHOLDER = "ARRAY_JOB_ID"  # in a --dry-run's summary.sbatch: the array's id is known only once submitted
SUMMARY_TIME = "01:00:00"  # the summary job: tables, figures and the postprocessing choice from the folds' files
# Host memory of one training process beyond its arena and its loader's batches (estimates, rounded up): the
# process itself (torch, the CUDA libraries and context on the host side, the model, a validation case) and
# each loader worker (its process and the float32 sample it builds while augmenting).
PROCESS_BYTES = 4 * GIB
WORKER_BYTES = 1 * GIB
# Loader workers per rank a job asks CPUs for when `data.loader_workers: auto` (which, on the node, takes the
# allocation's CPUs less one per rank): the workers only read, crop and pin (augmentation runs on the GPU),
# and one of them hands over a 192³ batch in well under the 0.25 s an H200 step takes
# (scripts/bench_pipeline.py), so 4 leave room for slow file systems.
AUTO_JOB_LOADER_WORKERS = 4


@dataclass
class SlurmOptions:
    """The `cv submit slurm` options; None = leave it to the cluster's defaults."""

    partition: str | None = None
    time: str | None = None  # per task, SLURM's formats (e.g. 24:00:00, 2-00:00:00)
    gpus_per_fold: int | None = None  # None: 1 unless train.device is cpu; > 1 runs the fold under torchrun
    cpus_per_fold: int | None = None
    mem: str | None = None
    account: str | None = None
    qos: str | None = None
    summary_partition: str | None = None  # None: the cluster's default partition (the summary needs no GPU)
    summary_time: str | None = None  # None: SUMMARY_TIME
    grace: int = 600  # seconds of warning before the time limit: enough for a step and a checkpoint
    sbatch_args: list[str] = field(default_factory=list)  # passed through verbatim, one `#SBATCH` line each

    def gpus(self, config: Config) -> int:
        if self.gpus_per_fold is not None:
            if self.gpus_per_fold < 0:
                raise ConfigError(f"--gpus-per-fold {self.gpus_per_fold}: must be 0 or more")
            return self.gpus_per_fold
        return 0 if config.train.device == "cpu" else 1


@dataclass
class SlurmSubmission:
    cv_script: Path
    summary_script: Path
    folds: list[int]
    array_job: str | None = None  # None: --dry-run
    summary_job: str | None = None


def unfinished_folds(config: Config, run: RunFolder) -> list[int]:
    """Folds of the run not yet trained and evaluated (splits.json's folds, else cv.folds of the config)."""
    n_folds = len(read_splits(run.splits)["folds"]) if run.splits.exists() else config.cv.folds
    return [k for k in range(n_folds) if not fold_standing(run, k).state.done]


def brats_swap_command() -> str:
    """This installation's brats-swap, so that the jobs run what was tested here (a venv need not be active)."""
    return f"{shell_word(sys.executable, 'the Python interpreter', 'cv submit slurm')} -m brats_swap"


def fold_resources(config: Config, gpus: int) -> tuple[int, str, str]:
    """(`--cpus-per-task`, `--mem`, how they were derived) of one fold task: `gpus` ranks (one without a
    GPU), each a process with its compute threads (`train.threads`, default 1), `data.loader_workers`
    workers, the batches they hold ahead and the pinned swap arena of the config's memory policy (for
    `memory.mode: auto`, that of swapping everything it could)."""
    ranks = max(gpus, 1)
    workers = AUTO_JOB_LOADER_WORKERS if config.data.loader_workers == "auto" else int(config.data.loader_workers)
    threads = config.train.threads or 1
    host = host_memory(config, arena_bound_bytes(config), workers)
    per_rank = PROCESS_BYTES + workers * WORKER_BYTES + host.total_bytes
    mem_gib = math.ceil(ranks * per_rank / GIB)
    how = (f"{ranks} rank(s) x ({workers} loader workers + {threads} compute thread(s)) CPUs; {ranks} x "
           f"({PROCESS_BYTES / GIB:g} GiB process + {workers} x {WORKER_BYTES / GIB:g} GiB workers + "
           f"{host.loader_bytes / GIB:.2f} GiB loader batches + {host.arena_bytes / GIB:.2f} GiB swap arena)")
    return ranks * (workers + threads), f"{mem_gib}G", how


def _line(value: object, what: str) -> str:
    """A value for a line of a job script: one line, no control character (`brats_swap.names`, rule 3)."""
    return script_text(value, what, "cv submit slurm")


# sbatch splits an `#SBATCH` line into arguments itself (SchedMD/slurm src/sbatch/opt.c, get_argument, so since
# 2009): an argument ends at unquoted whitespace; '...' or "..." group characters, whitespace and '#' included;
# a backslash makes the next character literal, inside quotes too; an unquoted '#' starts a comment; nothing
# continues a line. (24.05 also reads a backslash-space outside quotes as a space; older releases end the
# argument there, so the quoting below never relies on it.) A value with none of these characters is read as
# written.
_SBATCH_LITERAL = re.compile(r"[^\s\"'\\#]+")


def sbatch_word(value: object, what: str) -> str:
    """`value` as one argument of an `#SBATCH` line that sbatch reads back unchanged: as written when it needs
    no quoting (so ordinary scripts look as they always did), else in double quotes with `"` and `\\`
    backslashed. A newline or control character cannot be carried (one line, `_line`)."""
    text = _line(value, what)
    if _SBATCH_LITERAL.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_pattern(folder: Path, what: str) -> str:
    """`folder` as the start of an `--output` filename pattern that SLURM expands back to `folder`: `%` is
    written `%%`. A backslash anywhere in the pattern turns every `%` replacement off and is itself dropped
    (SchedMD/slurm src/common/print_fields.c expand_stdio_fields from 25.11, src/slurmd/common/fname.c
    remove_path_slashes before), so such a folder cannot be named there: DataError, one line."""
    text = _line(folder, what)
    if "\\" in text:
        # Shown as it is (one line: `_line` checked it), not repr()'d: that would double the backslash.
        raise DataError(f"cv submit slurm: {what} {text} holds a backslash, which a SLURM --output path cannot "
                        "hold (it turns off the %a/%j log names); use a folder without one")
    return text.replace("%", "%%")


def _directives(config: Config, options: SlurmOptions) -> list[str]:
    gpus = options.gpus(config)
    cpus, mem = options.cpus_per_fold, options.mem
    lines = []
    if cpus is None or mem is None:
        derived_cpus, derived_mem, how = fold_resources(config, gpus)
        cpus, mem = cpus if cpus is not None else derived_cpus, mem if mem is not None else derived_mem
        lines.append(f"# --cpus-per-task and --mem follow the config unless given (--cpus-per-fold, --mem): {how}")
    for flag, value in (("partition", options.partition), ("time", options.time), ("mem", mem),
                        ("account", options.account), ("qos", options.qos), ("cpus-per-task", cpus)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={_line(value, f'--{flag}')}")
    if gpus:
        lines.append(f"#SBATCH --gres=gpu:{gpus}")
    lines += [f"#SBATCH {_line(arg, '--sbatch-arg')}" for arg in options.sbatch_args]
    return lines


@dataclass(frozen=True)
class _ScriptValues:
    """The run folder, config name and working folder as the scripts hold them: `root` (the folder, for
    comments and shell words), `output` (the start of an `--output` pattern, unquoted), `name`, `chdir` (an
    `#SBATCH` word). Each checked for one line (a newline in a value would start a command)."""

    root: str
    output: str
    name: str
    chdir: str

    def output_directive(self, rest: str) -> str:
        """`--output=<run folder>/<rest>` as one sbatch argument; `rest` is a pattern of ours (`%a`, `%j`)."""
        return f"--output={sbatch_word(self.output + '/' + rest, 'the run folder')}"


def _script_values(config: Config, run: RunFolder) -> _ScriptValues:
    root = run.root.resolve()
    return _ScriptValues(root=_line(root, "the run folder"), output=output_pattern(root, "the run folder"),
                         name=checked_name(config.name, "config name", "cv submit slurm"),
                         chdir=sbatch_word(Path.cwd().resolve(), "the working folder"))


def check_paths(run_dir: RunFolder | Path) -> None:
    """Refuse (DataError, one line) a run folder or working folder that the scripts' `#SBATCH` lines cannot
    carry, before anything is written: for a caller that writes into the run folder before `submit_cv`."""
    root = RunFolder.of(run_dir).root.resolve()
    output_pattern(root, "the run folder")
    sbatch_word(Path.cwd().resolve(), "the working folder")


def cv_script(config: Config, run: RunFolder, folds: list[int], options: SlurmOptions) -> str:
    """The array job's script (see the module docstring)."""
    if options.grace <= 0:
        raise ConfigError(f"--grace {options.grace}: must be a positive number of seconds")
    values = _script_values(config, run)
    gpus = options.gpus(config)
    nproc = f" --nproc {gpus}" if gpus > 1 else ""  # the fold under torchrun, one rank per GPU
    return "\n".join([
        "#!/bin/bash",
        f"# brats-swap cross-validation of {values.root}: one array task per fold.",
        "# Written by `brats-swap cv submit slurm`; edit freely, resubmit it with `sbatch <this file>`.",
        f"#SBATCH --job-name=cv-{values.name}",
        f"#SBATCH --array={','.join(str(k) for k in folds)}",
        f"#SBATCH {values.output_directive('fold_%a/slurm-%A_%a.log')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{options.grace}",
        "#SBATCH --requeue",
        f"#SBATCH --chdir={values.chdir}",
        *_directives(config, options),
        "",
        f"BRATS_SWAP=({brats_swap_command()})",
        f"RUN={shell_word(values.root, 'the run folder', 'cv submit slurm')}",
        'fold="$SLURM_ARRAY_TASK_ID"',
        'echo "$(date -u +%FT%TZ) job $SLURM_JOB_ID (array $SLURM_ARRAY_JOB_ID, fold $fold) on $(hostname),'
        ' restart ${SLURM_RESTART_COUNT:-0}"',
        "",
        f"# SLURM sends SIGUSR1 to this shell {options.grace} s before the time limit or a preemption: pass it to",
        "# brats-swap, which saves a checkpoint at the next step and exits 0; then requeue this task, which",
        "# resumes inside the epoch.",
        "warned=0",
        "trap 'warned=1; kill -USR1 \"$pid\" 2>/dev/null' USR1",
        f'"${{BRATS_SWAP[@]}}" cv run --config "$RUN/config.yaml" --run "$RUN" --fold "$fold"{nproc} &',
        "pid=$!",
        "# `wait` returns when a trapped signal arrives; wait again until brats-swap itself has exited.",
        'while true; do wait "$pid"; status=$?; kill -0 "$pid" 2>/dev/null || break; done',
        "# Requeued whatever the exit status: a signal that came before brats-swap could handle it (while it",
        "# started) ended it without a checkpoint of this call, and the requeued task resumes from the last one.",
        'if [ "$warned" = 1 ]; then',
        '    echo "$(date -u +%FT%TZ) brats-swap exited with status $status; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
        "",
    ])


def summary_script(config: Config, run: RunFolder, array_job: str, options: SlurmOptions) -> str:
    """The summary job's script: after every array task has ended, however it ended."""
    values = _script_values(config, run)
    lines = [
        "#!/bin/bash",
        f"# brats-swap cross-validation of {values.root}: the summary, after the folds' array job.",
        "# Written by `brats-swap cv submit slurm`; edit freely.",
        f"#SBATCH --job-name=cv-{values.name}-summary",
        f"#SBATCH --dependency=afterany:{_line(array_job, 'the array job id')}",
        f"#SBATCH {values.output_directive(f'{SLURM_FOLDER}/summary-%j.log')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={values.chdir}",
        "# No GPU: the summary reads the folds' files.",
        f"#SBATCH --time={_line(options.summary_time or SUMMARY_TIME, '--summary-time')}",
    ]
    for flag, value in (("partition", options.summary_partition), ("account", options.account),
                        ("qos", options.qos)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={_line(value, f'--{flag}')}")
    lines += [
        "",
        f"BRATS_SWAP=({brats_swap_command()})",
        f"RUN={shell_word(values.root, 'the run folder', 'cv submit slurm')}",
        '"${BRATS_SWAP[@]}" cv summary --config "$RUN/config.yaml" --run "$RUN"',
        "",
    ]
    return "\n".join(lines)


def _sbatch(script: Path, *extra: str) -> str:
    """Submit with `sbatch --parsable`; the job id."""
    done = subprocess.run(["sbatch", "--parsable", *extra, str(script)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = " ".join((done.stderr or done.stdout).split()) or f"exit {done.returncode}"
        raise DataError(f"{script}: sbatch refused it: {reason}")
    return done.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"


def submit_cv(config: Config, run_dir: RunFolder | Path, options: SlurmOptions, *, dry_run: bool = False
              ) -> SlurmSubmission:
    """Write `RUN/slurm/cv.sbatch` and `summary.sbatch` and submit them (not with `dry_run`).

    The run's `config.yaml` must exist (the caller records it first, after `check_paths`: the jobs read it).
    Raises DataError (one line) when there is nothing to train, when a path cannot go into a script (before
    anything is written), or when `sbatch` is missing or refuses a script.
    """
    run = RunFolder.of(run_dir)
    folds = unfinished_folds(config, run)
    folder = run.root / SLURM_FOLDER
    submission = SlurmSubmission(cv_script=folder / "cv.sbatch", summary_script=folder / "summary.sbatch",
                                 folds=folds)
    if not folds:
        raise DataError(f"{run.root}: every fold is done; nothing to submit (see `brats-swap cv status --run "
                        f"{run.root}`)")
    if not dry_run and shutil.which("sbatch") is None:
        raise DataError("sbatch: not found on the PATH; run this on a SLURM login node (or use --dry-run to "
                        "write the scripts only)")
    # Both scripts first: a value they cannot carry is refused here, before a folder or a script is written.
    cv_text = cv_script(config, run, folds, options)
    placeholder_summary = summary_script(config, run, ARRAY_PLACEHOLDER, options)
    folder.mkdir(parents=True, exist_ok=True)
    for k in folds:
        run.fold(k).root.mkdir(parents=True, exist_ok=True)  # SLURM opens the task's log there before it starts
    atomic_write_text(submission.cv_script, cv_text)
    os.chmod(submission.cv_script, 0o755)
    if dry_run:
        atomic_write_text(submission.summary_script, placeholder_summary)
        return submission
    submission.array_job = _sbatch(submission.cv_script)
    atomic_write_text(submission.summary_script, summary_script(config, run, submission.array_job, options))
    submission.summary_job = _sbatch(submission.summary_script)
    return submission


__all__ = ["SlurmOptions", "SlurmSubmission", "check_paths", "cv_script", "fold_resources", "output_pattern",
           "sbatch_word", "submit_cv", "summary_script", "unfinished_folds"]
