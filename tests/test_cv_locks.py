"""Fold-level locks (cv/lock.py) with the scripted training loop: different folds of one run advance at once,
the same fold twice exits 75 touching nothing, the run's shared files wait for each other, and a file system
without flock is a one-line error. tests/test_slurm.py runs two folds at once for real, as array tasks."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

import pytest
from cv_helpers import install_fake_training, snapshot

from brats_swap.config import load_config
from brats_swap.cv import lock
from brats_swap.cv.dispatch import run_cv
from brats_swap.cv.lock import fold_locks, run_lock, shared_files
from brats_swap.errors import DataError, RunLockedError


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return install_fake_training(monkeypatch, tmp_path)


@pytest.fixture
def config(tmp_path):
    return load_config(None, [f"data.cache={tmp_path / 'cache'}", "cv.folds=2", "train.max_epochs=2", "name=fake"])


def test_another_fold_runs_while_one_is_held_and_the_same_fold_exits_75(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    run_cv(config, run_dir, folds=0, max_hours=1e-9)  # makes splits.json, trains nothing
    with fold_locks(run_dir, [0]):  # another machine works on fold 0
        outcome = run_cv(config, run_dir, folds=1)
        assert outcome.complete and outcome.done == [1]
        before = snapshot(run_dir, ignore=(".lock",))
        with pytest.raises(RunLockedError, match="fold 0 is being worked on") as error:
            run_cv(config, run_dir, folds=0)
        assert error.value.exit_code == 75
        with pytest.raises(RunLockedError, match="fold 0"):
            run_cv(config, run_dir)  # all folds: one of them is held
        assert snapshot(run_dir, ignore=(".lock",)) == before  # not even a cv.log line
    # Only fold 1 so far: its call summarised the fold it was asked for.
    assert json.loads((run_dir / "cv_summary.json").read_text())["folds_done"] == [1]
    # The call that finishes the run's last fold summarises every fold, whoever trained the others.
    last = run_cv(config, run_dir, folds=0)
    assert last.done == [0]
    summary = json.loads((run_dir / "cv_summary.json").read_text())
    assert summary["complete"] and summary["folds_done"] == [0, 1] and len(summary["folds"]) == 2
    assert [call[0] for call in fake.calls] == [1, 0]


def test_the_whole_run_held_refuses_every_fold(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    with run_lock(run_dir), pytest.raises(RunLockedError, match="holds the whole run"):
        run_cv(config, run_dir, folds=1)
    assert fake.calls == []


def test_shared_files_sections_wait_for_each_other_and_time_out(tmp_path):
    entered = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with shared_files(tmp_path):
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait(10)
    try:
        with pytest.raises(RunLockedError, match="more than 0 s"):
            with shared_files(tmp_path, timeout_s=0.2, poll_s=0.01):
                pass
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        with shared_files(tmp_path, timeout_s=10, poll_s=0.01):  # waits for the holder, then enters
            waited = time.monotonic() - started
    finally:
        release.set()
        holder.join()
    assert waited >= 0.2


def test_a_file_system_without_flock_is_a_one_line_error(fake, config, tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    with pytest.raises(DataError, match=r"does not support flock .*-o flock") as error:
        run_cv(config, tmp_path / "run")
    assert "\n" not in str(error.value) and fake.calls == []


def test_status_shows_done_running_and_stopped_folds(fake, config, tmp_path, monkeypatch):
    from brats_swap.cv.status_report import run_status

    run_dir = tmp_path / "run"
    run_cv(config, run_dir, folds=0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with fold_locks(run_dir, [1]):
        lines = [status.line() for status in run_status(run_dir)]
    assert lines[0].startswith("fold 0: done")
    assert lines[1].startswith(f"fold 1: running (pid {os.getpid()} on {socket.gethostname()}, SLURM job 4242)")
    assert [status.state for status in run_status(run_dir)] == ["done", "not started"]
