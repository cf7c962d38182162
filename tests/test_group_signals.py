"""Signals as a scheduler sends them: to every process of the job (`kill -TERM -- -PGID`, what `timeout` does
and SLURM does at a time limit, on `scancel` and on preemption), DataLoader workers included, while they
run; and SIGKILL to the whole job, then a rerun at once.

The workers leave the stop signals to the main process, so the command stops after the running step with
`checkpoint_latest.pt` and exit 0, for `train`, `train --nproc 2` (torchrun gets the signal too) and
`cv --parallel-folds 2`. Workers never hold the run's locks, so a rerun right after SIGKILL resumes.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import descendants
from forked_cli import ForkedCli
from train_helpers import SMALL, small_dataset

from brats_swap.cv.lock import fold_holder, fold_work
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST

WORKERS = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


def _arguments(data, run: Path, *args: str, steps: int = 2000, epochs: int = 1) -> list[str]:
    root, cache = data
    sets = [f"data.root={root}", f"data.cache={cache}", *SMALL, f"data.loader_workers={WORKERS}",
            "model.base_filters=2", "train.device=cpu", "cv.folds=2", f"train.steps_per_epoch={steps}",
            f"train.max_epochs={epochs}", "train.threads=1", "train.val_every=1000", "evaluate.hd95=false",
            "name=tiny"]
    return [*args, "--run", str(run), *[arg for item in sets for arg in ("--set", item)]]


def _command(data, run: Path, *args: str, steps: int = 2000, epochs: int = 1) -> list[str]:
    return [sys.executable, "-m", "brats_swap", *_arguments(data, run, *args, steps=steps, epochs=epochs)]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _loader_workers(pid: int) -> list[int]:
    """The DataLoader workers below `pid`, once they run: the Python leaves of its process tree (ranks and
    fold workers have them as children), multiprocessing's resource tracker aside."""
    python = Path(sys.executable).resolve()
    leaves = []
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            has_children = any((task / "children").read_text().split()
                               for task in Path(f"/proc/{child}/task").glob("*"))
            if (not has_children and Path(f"/proc/{child}/exe").resolve() == python
                    and b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()):
                leaves.append(child)
    return leaves


def _start(command: list[str], output: Path) -> subprocess.Popen:
    """In a session of its own: its process group is the job, as a scheduler sees it. Output to a file, not a
    pipe: processes that outlive the job's main process would keep a pipe open."""
    with open(output, "w", encoding="utf-8") as sink:
        return subprocess.Popen(command, env=_environment(), start_new_session=True, stdout=sink,
                                stderr=subprocess.STDOUT)


def _wait_for_loader_workers(job: subprocess.Popen, count: int, timeout: float = 180, settle_s: float = 0.5,
                             ) -> list[int]:
    """`count` loader workers running, then `settle_s` more (training steps are running, the workers loading)."""
    deadline = time.monotonic() + timeout
    while len(workers := _loader_workers(job.pid)) < count:
        assert job.poll() is None, job.args
        assert time.monotonic() < deadline, f"no {count} loader workers within {timeout} s"
        time.sleep(0.05)
    time.sleep(settle_s)
    return workers


def _signal_group_and_wait(job: subprocess.Popen, signum: int, output: Path, timeout: float = 180) -> str:
    try:
        os.killpg(job.pid, signum)
        job.wait(timeout=timeout)
        return output.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


def _assert_stopped_mid_epoch(output: str, fold_dir: Path, world_size: int | None = None) -> None:
    assert "Traceback" not in output and "killed by signal" not in output, output[-3000:]
    saved = load_checkpoint(fold_dir / LATEST)
    assert saved["epoch"] == 0 and 0 < saved["step_in_epoch"] < 2000 and not saved["finished"]
    if world_size is not None:
        assert saved["world_size"] == world_size
    assert f"SIGTERM at epoch 1 step {saved['step_in_epoch']}; state saved" in (fold_dir / "train.log").read_text()


def test_sigterm_to_the_group_of_train_stops_with_a_checkpoint(data, tmp_path):
    run = tmp_path / "run"
    job = _start(_command(data, run, "train"), tmp_path / "output")
    _wait_for_loader_workers(job, WORKERS)
    output = _signal_group_and_wait(job, signal.SIGTERM, tmp_path / "output")
    assert job.returncode == 0, output[-3000:]
    _assert_stopped_mid_epoch(output, run / "fold_0")


@pytest.mark.skipif(shutil.which("ps") is None, reason="procps' ps not installed")
def test_under_a_wrapper_the_group_that_ps_names_stops_train_with_a_checkpoint(data, tmp_path):
    """issue 54: under a wrapper (here the shell of a script) brats-swap does not lead its process group, and
    `kill -- -<its PID>` finds nothing. The group docs/stopping.md takes from `ps -o pgid=` is the wrapper's;
    a SIGTERM to it ends the shell at once and stops brats-swap after its step, with the checkpoint saved."""
    run = tmp_path / "run"
    job = _start(["bash", "-c", f"{shlex.join(_command(data, run, 'train'))}; exit $?"], tmp_path / "output")
    _wait_for_loader_workers(job, WORKERS)
    (brats_swap,) = [pid for pid in descendants(job.pid) if pid not in _loader_workers(job.pid)
                     and b"brats_swap" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    with pytest.raises(ProcessLookupError):
        os.killpg(brats_swap, 0)  # its PID is not a group id
    group = int(subprocess.run(["ps", "-o", "pgid=", "-p", str(brats_swap)], capture_output=True, text=True,
                               check=True).stdout)
    assert group == job.pid
    try:
        os.killpg(group, signal.SIGTERM)
        job.wait(timeout=60)
        deadline = time.monotonic() + 180
        while _state(brats_swap) not in (None, "Z"):  # not our child: watched until it has gone
            assert time.monotonic() < deadline, "brats-swap did not stop within 180 s of the SIGTERM"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    _assert_stopped_mid_epoch((tmp_path / "output").read_text(), run / "fold_0")


@pytest.mark.slow
def test_sigterm_to_the_group_of_train_nproc_stops_both_ranks_with_a_checkpoint(data, tmp_path):
    """torchrun and the launcher get the signal too; the ranks (and their loader workers) get it from
    torchrun's shutdown and the launcher's forwarding, and stop at one agreed step, exit 0."""
    run = tmp_path / "run"
    job = _start(_command(data, run, "train", "--nproc", "2"), tmp_path / "output")
    _wait_for_loader_workers(job, 2 * WORKERS)
    output = _signal_group_and_wait(job, signal.SIGTERM, tmp_path / "output")
    assert job.returncode == 0, output[-3000:]
    assert "SignalException" not in output, output[-3000:]
    _assert_stopped_mid_epoch(output, run / "fold_0", world_size=2)


@pytest.mark.slow
def test_sigterm_to_the_group_of_cv_parallel_folds_stops_every_fold_with_a_checkpoint(data, tmp_path):
    run = tmp_path / "run"
    job = _start(_command(data, run, "cv", "--parallel-folds", "2"), tmp_path / "output")
    _wait_for_loader_workers(job, 2 * WORKERS)
    output = _signal_group_and_wait(job, signal.SIGTERM, tmp_path / "output")
    assert job.returncode == 0, output[-3000:]
    for fold in (0, 1):
        worker_log = (run / f"fold_{fold}" / "cv_worker.log").read_text()
        _assert_stopped_mid_epoch(output + worker_log, run / f"fold_{fold}")


# A process that trains as `train` holds its fold: the fold's lock, then a DataLoader whose forked workers are
# busy loading (a slow volume), when it is SIGKILLed.
HOLD_AND_LOAD = """
import sys, time
from pathlib import Path
from torch.utils.data import DataLoader, Dataset
from brats_swap.cv.lock import fold_work
from brats_swap.train.data import seed_worker

class SlowVolumes(Dataset):
    def __len__(self):
        return 100
    def __getitem__(self, index):
        Path(sys.argv[2], f"loading.{index}").touch()
        time.sleep(60)
        return index

with fold_work(Path(sys.argv[1]), [0]):
    for batch in DataLoader(SlowVolumes(), num_workers=2, worker_init_fn=seed_worker):
        pass
"""


def test_the_fold_is_free_the_moment_its_process_is_sigkilled_while_workers_load(tmp_path):
    """Workers never hold the run's locks: SIGKILL the process (the OOM killer, a failing node) while its
    workers are in the middle of loading, and the fold can be taken at once, before they notice."""
    run, marks = tmp_path / "run", tmp_path / "marks"
    run.mkdir()
    marks.mkdir()
    script = tmp_path / "hold_and_load.py"
    script.write_text(HOLD_AND_LOAD)
    job = _start([sys.executable, str(script), str(run), str(marks)], tmp_path / "output")
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < 2:  # both workers are loading
            assert job.poll() is None, job.args
            assert time.monotonic() < deadline, "the workers did not start loading within 120 s"
            time.sleep(0.05)
        workers = _loader_workers(job.pid)
        assert len(workers) == 2
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        assert all(_state(pid) not in ("Z", None) for pid in workers)  # alive, still loading
        assert fold_holder(run, 0) is None
        with fold_work(run, [0]):  # what the rerun takes first; RunLockedError (exit 75) before the fix
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.mark.slow
def test_a_rerun_right_after_sigkill_of_train_resumes(data, tmp_path):
    """`train` SIGKILLed while its loader workers run (they outlive it for up to a few seconds): the fold is
    free at once, and `train --resume` started right away continues from the last checkpoint."""
    run = tmp_path / "run"
    # SIGKILL leaves the process no last word: forked from this one (tests/forked_cli.py), in a session of its own;
    # its loader workers are its own forks, as under `python -m brats_swap`.
    with ForkedCli(_arguments(data, run, "train", steps=24, epochs=1000), new_session=True) as job:
        latest = run / "fold_0" / LATEST
        try:
            deadline = time.monotonic() + 180
            while not latest.exists():  # the end of epoch 1
                assert job.poll() is None, "".join(job.output())[-3000:]
                assert time.monotonic() < deadline, "no checkpoint within 180 s"
                time.sleep(0.05)
            workers = _wait_for_loader_workers(job, WORKERS, settle_s=0.0)  # an epoch's workers, just started
            os.kill(job.pid, signal.SIGKILL)
            job.wait()
            assert any(_state(pid) not in ("Z", None) for pid in workers)
            assert fold_holder(run, 0) is None
            target = load_checkpoint(latest)["epoch"] + 1
            rerun = subprocess.run(_command(data, run, "train", "--resume", steps=24, epochs=target),
                                   env=_environment(), capture_output=True, text=True, timeout=180)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resume fold 0 at epoch {target} step 0" in (run / "fold_0" / "train.log").read_text()
    assert load_checkpoint(latest)["finished"]
