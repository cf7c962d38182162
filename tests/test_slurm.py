"""`brats-swap cv submit` on a real SLURM (marked `slurm`; `.ci/run` starts one with
scripts/local_slurm.sh, elsewhere this test is skipped): a 2-fold cv on 16³ phantoms, in a run folder whose
path holds a space, quotes, `#` and `%`, as an array job, one
task preempted mid-epoch with SIGUSR1 as SLURM's `--signal` would, requeued once, resumed inside the epoch and
bitwise equal at the end to the fold trained straight through in one process; the summary job's
cv_summary.json and postprocessing.json; `cv status`. Nothing is left running.

Without SLURM: the scripts' `#SBATCH` lines read back, by a port of sbatch's own parser and of SLURM's
`--output` pattern expansion, to exactly a run folder and working folder holding spaces, quotes, `#`, `$` and
`%`; their shell lines to the same run folder in bash; a folder with a newline (any line) or a backslash (the
`--output` pattern) is refused in one line before anything is written."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import SMALL, assert_same_training_state, small_dataset, tiny_config

from brats_swap.config import config_to_yaml, load_config
from brats_swap.cv.slurm import SLURM_FOLDER, SlurmOptions, check_paths, submit_cv
from brats_swap.errors import DataError
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST, RunFolder
from brats_swap.train.loop import train_fold

# 2 folds of 1 epoch of 64 steps (about 3 s on an idle 2-core machine, more under load): long enough for the
# signal to land inside the epoch (16 steps took 0.8 s on an idle machine and finished before it arrived).
STEPS = 64
RECIPE = [*SMALL, "train.max_epochs=1", f"train.steps_per_epoch={STEPS}", "train.threads=1", "name=slurm-tiny"]
TIMEOUT_S = 240


def slurm_running() -> bool:
    if shutil.which("sinfo") is None:
        return False
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, check=False)
    return done.returncode == 0 and any(s in done.stdout for s in ("idle", "mixed", "allocated"))


def scontrol_job(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=False).stdout


def wait_for(condition, what: str, timeout_s: float = TIMEOUT_S, logs: tuple[Path, ...] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{tails}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


@pytest.mark.slurm
def test_cv_submitted_to_slurm_survives_a_preemption_bitwise(data, tmp_path):
    if not slurm_running():
        pytest.skip("no SLURM running here (start one with: sudo scripts/local_slurm.sh start)")
    config = tiny_config(*data, *RECIPE)
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(config_to_yaml(config))
    # A run folder sbatch must be given quoted, with a `%` SLURM must not expand (see the tests below).
    run = tmp_path / 'cv "run" 100% #1'
    command = [sys.executable, "-m", "brats_swap", "cv"]
    submitted = subprocess.run([*command, "--submit", "slurm", "--config", str(config_file), "--run", str(run),
                                "--time", "00:20:00", "--cpus-per-fold", "1", "--grace", "60"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    match = re.search(r"array job (\d+) .* as job (\d+)", submitted.stdout)
    assert match, submitted.stdout
    array, summary_job = match.groups()
    task_log = run / "fold_0" / f"slurm-{array}_0.log"
    train_log = run / "fold_0" / "train.log"
    try:
        script = (run / "slurm" / "cv.sbatch").read_text()
        for line in ("#SBATCH --array=0,1", "#SBATCH --signal=B:USR1@60", "#SBATCH --requeue",
                     "#SBATCH --open-mode=append", "#SBATCH --time=00:20:00", "#SBATCH --cpus-per-task=1"):
            assert line in script
        assert f"#SBATCH --dependency=afterany:{array}" in (run / "slurm" / "summary.sbatch").read_text()

        # Preempt fold 0 once its training runs: the warning SLURM gives before a time limit.
        wait_for(lambda: train_log.exists() and "start fold 0" in train_log.read_text(), "fold 0 training",
                 logs=(task_log,))
        time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", "--batch", f"{array}_0"], check=True)
        # Meanwhile, the reference: the same fold straight through in this process.
        reference = train_fold(config, tmp_path / "straight", 0, progress=False)
        assert reference.finished

        def all_ended() -> bool:
            queue = subprocess.run(["squeue", "-h", "-j", f"{array},{summary_job}"], capture_output=True, text=True)
            return queue.returncode == 0 and not queue.stdout.strip()

        wait_for(all_ended, "the array and the summary job", logs=(task_log, train_log))
        assert "Restarts=1" in scontrol_job(f"{array}_0"), scontrol_job(f"{array}_0")
        log = train_log.read_text()
        stopped = re.search(r"SIGUSR1 at epoch (\d+) step (\d+); state saved", log)
        assert stopped, log
        epoch, step = stopped.groups()
        assert 0 < int(step) < STEPS and f"resume fold 0 at epoch {epoch} step {step}" in log  # mid-epoch, both
        assert "exited with status 0; requeueing job" in task_log.read_text()
        assert_same_training_state(load_checkpoint(run / "fold_0" / LATEST),
                                   load_checkpoint(tmp_path / "straight" / "fold_0" / LATEST))

        summary = json.loads((run / "cv_summary.json").read_text())
        assert summary["complete"] and summary["folds_done"] == [0, 1]
        assert (run / "postprocessing.json").exists()
        status = subprocess.run([*command, "--status", "--run", str(run)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert [line.split(":")[1].split(",")[0].strip() for line in status.stdout.splitlines()] == ["done", "done"]
    finally:
        subprocess.run(["scancel", array, summary_job], check=False)


# ---- paths in the `#SBATCH` lines, without SLURM ----------------------------------------------------------------

C_SPACE = " \t\n\v\f\r"  # C's isspace() in the C locale


def _get_argument(line: str, space_escape: bool) -> tuple[str | None, str]:
    """(the next argument, the rest of the line): SchedMD/slurm src/sbatch/opt.c, get_argument, line by line.
    `space_escape`: 24.05's backslash-space outside quotes, a space in the argument (commit d44b67f7be); before
    it, the backslash was dropped and the space ended the argument (Debian 12's 22.05, which CI installs)."""
    i = 0
    while i < len(line) and line[i] in C_SPACE:
        i += 1
    assert not line[i:].startswith(":"), f"sbatch: fatal: Unexpected `:` in [{line}]"
    argument: list[str] = []
    quote, escaped = None, False
    while i < len(line) and (quote or line[i] not in C_SPACE):
        char = line[i]
        if escaped:
            escaped = False
        elif char == "\\":
            i += 1
            if space_escape and line[i:i + 1] == " ":
                argument.append(" ")
                i += 1
            else:
                escaped = True
            continue
        elif quote:
            if char == quote:
                quote = None
                i += 1
                continue
        elif char in "\"'":
            quote = char
            i += 1
            continue
        elif char == "#":  # an unquoted '#': the rest of the line is a comment
            break
        argument.append(char)
        i += 1
    assert quote is None, f"sbatch: fatal: Unmatched `{quote}` in [{line}]"
    return ("".join(argument) if argument else None), line[i:]


def sbatch_arguments(script: str, space_escape: bool = False) -> list[str]:
    """The arguments sbatch takes from a script: src/sbatch/opt.c, _opt_batch_script (lines that start with
    `#SBATCH`, up to the first command; for each, get_argument until it returns nothing)."""
    arguments = []
    for line in script.split("\n"):
        if not line.startswith("#SBATCH"):
            if line.strip(C_SPACE) and not line.strip(C_SPACE).startswith("#"):
                break
            continue
        rest = line[len("#SBATCH"):]
        while True:
            argument, rest = _get_argument(rest, space_escape)
            if argument is None:
                break
            arguments.append(argument)
    return arguments


def expand_output(pattern: str, fields: dict[str, int]) -> str:
    """An `--output` filename pattern as SLURM expands it: src/common/print_fields.c, expand_stdio_fields
    (`%%` is `%`; `%X` of a known field its value, zero-padded to an optional width; an unknown `%X` stays;
    any backslash turns replacement off, and backslashes are dropped)."""
    if "\\" in pattern:
        return pattern.replace("\\", "")
    expanded, i = [], 0
    while i < len(pattern):
        if pattern[i] != "%":
            expanded.append(pattern[i])
            i += 1
            continue
        width = re.match(r"\d*", pattern[i + 1:]).group()
        field = pattern[i + 1 + len(width):i + 2 + len(width)]
        if field == "%" and not width:
            expanded.append("%")
        elif field in fields:
            expanded.append(f"{fields[field]:0{min(int(width or 0), 10)}d}")
        else:
            expanded.append(pattern[i:i + 2 + len(width)])
        i += 2 + len(width)
    return "".join(expanded)


def test_the_port_of_sbatchs_parser_reads_what_its_comments_say():
    # The rules of src/sbatch/opt.c the ports above follow, each on a line as sbatch's comments describe it.
    assert sbatch_arguments('#SBATCH --a=x y "q r" \'s t\' u\\"v # c\n#SBATCH --b=%%\necho\n#SBATCH --c') == \
        ["--a=x", "y", "q r", "s t", 'u"v', "--b=%%"]
    assert sbatch_arguments('#SBATCH --a="x\\\\y\\"z"') == ['--a=x\\y"z']
    assert sbatch_arguments("#SBATCH --a=x\\ y") == ["--a=x", "y"] and \
        sbatch_arguments("#SBATCH --a=x\\ y", space_escape=True) == ["--a=x y"]
    assert expand_output("/r/%%a/%a/%4A/%j/%q", {"a": 3, "A": 12, "j": 5}) == "/r/%a/3/0012/5/%q"
    assert expand_output("/r\\/%a", {"a": 3}) == "/r/%a"


AWKWARD = "runs 100% #1 'it''s' \"quoted\" $HOME `x` %j ;&|"


def _config():
    return load_config(None, ["name=awkward", "train.device=cpu", "cv.folds=2"])


def _options() -> SlurmOptions:
    return SlurmOptions(cpus_per_fold=1, mem="1G", partition="debug", time="01:00:00")


def _directive(arguments: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in arguments if a.startswith(f"{flag}=")]
    assert len(values) == 1, arguments
    return values[0]


@pytest.mark.parametrize("space_escape", [False, True], ids=["sbatch-22.05", "sbatch-24.05"])
def test_a_run_folder_with_spaces_quotes_and_percent_reads_back_exactly(tmp_path, monkeypatch, space_escape):
    cwd = tmp_path / "work dir \"#2\" 50%"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root = (tmp_path / AWKWARD / "run").resolve()
    submission = submit_cv(_config(), RunFolder(root), _options(), dry_run=True)
    cv, summary = submission.cv_script.read_text(), submission.summary_script.read_text()
    for script, log, fields in ((cv, "fold_1/slurm-77_1.log", {"A": 77, "a": 1, "j": 78}),
                                (summary, f"{SLURM_FOLDER}/summary-90.log", {"j": 90})):
        arguments = sbatch_arguments(script, space_escape)
        # Every argument is an option: a stray word is sbatch's "Invalid directive found in batch script".
        assert all(a.startswith("--") for a in arguments), arguments
        assert expand_output(_directive(arguments, "--output"), fields) == f"{root}/{log}"
        assert _directive(arguments, "--chdir") == str(cwd.resolve())
    assert _directive(sbatch_arguments(cv), "--array") == "0,1"
    assert _directive(sbatch_arguments(cv), "--partition") == "debug"
    # The shell lines: bash reads the same run folder back.
    for script in (cv, summary):
        run_line = next(line for line in script.splitlines() if line.startswith("RUN="))
        shown = subprocess.run(["bash", "-c", f'{run_line}\nprintf %s "$RUN"'], capture_output=True, text=True,
                               check=True)
        assert shown.stdout == str(root)
    assert subprocess.run(["bash", "-n", str(submission.cv_script)], check=False).returncode == 0


def test_an_ordinary_run_folder_is_written_without_quotes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = (tmp_path / "runs" / "plain-1").resolve()
    cv = submit_cv(_config(), RunFolder(root), _options(), dry_run=True).cv_script.read_text()
    assert f"#SBATCH --output={root}/fold_%a/slurm-%A_%a.log\n" in cv
    assert f"#SBATCH --chdir={tmp_path.resolve()}\n" in cv


@pytest.mark.parametrize(("where", "folder", "shown", "problem"), [
    ("run", "bad\nname", "bad\\nname", "holds a newline or control character"),
    ("run", "bad\\name", "bad\\name holds", "holds a backslash, which a SLURM --output path cannot hold"),
    ("cwd", "bad\nwork", "bad\\nwork", "holds a newline or control character"),
])
def test_a_folder_sbatch_cannot_carry_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch,
                                                                                         where, folder, shown,
                                                                                         problem):
    cwd = tmp_path / (folder if where == "cwd" else "work")
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    root = tmp_path / (folder if where == "run" else "run")
    for attempt in (lambda: check_paths(root), lambda: submit_cv(_config(), RunFolder(root), _options(),
                                                                 dry_run=True)):
        with pytest.raises(DataError) as caught:
            attempt()
        message = str(caught.value)
        assert "\n" not in message and problem in message, message
        assert ("the run folder" if where == "run" else "the working folder") in message
        assert shown in message  # the folder, on one line
    assert not root.exists()  # nothing written: no run folder, no script, no fold folder


def test_a_backslash_in_the_working_folder_is_quoted_not_refused(tmp_path, monkeypatch):
    cwd = tmp_path / "back\\slash"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cv = submit_cv(_config(), RunFolder(tmp_path / "run"), dataclasses.replace(_options()), dry_run=True)
    assert _directive(sbatch_arguments(cv.cv_script.read_text()), "--chdir") == str(cwd.resolve())
