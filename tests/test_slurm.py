"""`brats-swap cv submit` on a real SLURM (marked `slurm`; `.ci/run` starts one with
scripts/local_slurm.sh, elsewhere this test is skipped): a 2-fold cv on 16³ phantoms as an array job, one
task preempted mid-epoch with SIGUSR1 as SLURM's `--signal` would, requeued once, resumed inside the epoch and
bitwise equal at the end to the fold trained straight through in one process; the summary job's
cv_summary.json and postprocessing.json; `cv status`. Nothing is left running."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import SMALL, assert_same_training_state, small_dataset, tiny_config

from brats_swap.config import config_to_yaml
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST
from brats_swap.train.loop import train_fold

pytestmark = pytest.mark.slurm

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


def test_cv_submitted_to_slurm_survives_a_preemption_bitwise(data, tmp_path):
    if not slurm_running():
        pytest.skip("no SLURM running here (start one with: sudo scripts/local_slurm.sh start)")
    config = tiny_config(*data, *RECIPE)
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(config_to_yaml(config))
    run = tmp_path / "run"
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
