"""Crashes: SIGKILL at the worst moments of training and preparation, and corrupted checkpoints.

After a kill, every visible result file is complete (temp + fsync + rename), and re-running continues
with at most the interrupted epoch lost; an interrupted-then-resumed run ends with the same losses as an
uninterrupted one. A corrupted checkpoint is detected by its checksum and the previous one is used, with a
warning.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
from failure_helpers import (
    REPO,
    assert_no_half_written_files,
    error_line,
    invoke,
    leftovers,
    run_killed_at,
    says,
    set_args,
    squash,
)
from forked_cli import ForkedCli

from brats_swap.errors import EXIT_BAD_INPUT
from brats_swap.run.checkpoint import load_checkpoint, load_latest
from brats_swap.run.folder import BEST, LATEST, PREVIOUS

EPOCHS = "train.max_epochs=3"


def _losses(run) -> list[float]:
    return [record["train_loss"] for record in load_checkpoint(run / "fold_0" / LATEST)["history"]]


@pytest.mark.parametrize(
    ("kill_at", "resumed_epoch"),
    [
        # the first checkpoint is complete in its temp file but not yet renamed: nothing to resume from
        ("checkpoint_latest.pt:1:before", None),
        # epoch 2's save: latest already rotated to prev, the new latest not yet in place
        ("checkpoint_prev.pt:1:after", 1),
        # just after epoch 2's checkpoint landed
        ("checkpoint_latest.pt:2:after", 2),
    ],
    ids=["first-save-before-rename", "between-rotation-and-rename", "after-epoch-2"],
)
def test_sigkill_during_training_then_resume(prepared_cache, trained_run, tmp_path, kill_at, resumed_epoch):
    run = tmp_path / "run"
    killed = run_killed_at(["train", "--run", run, *set_args(prepared_cache, EPOCHS)], kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert_no_half_written_files(run)

    fold_dir = run / "fold_0"
    loaded = load_latest(fold_dir)
    assert (loaded[0]["epoch"] if loaded else None) == resumed_epoch

    resumed = invoke("train", "--run", run, "--resume", *set_args(prepared_cache, EPOCHS))
    assert resumed.exit_code == 0, resumed.output
    if kill_at.startswith("checkpoint_prev"):
        assert says(resumed.output, "falling back to checkpoint_prev.pt (epoch 1)")
    assert_no_half_written_files(run)
    assert leftovers(run) == []  # the killed writer's temp file was cleaned up by the re-run
    state = load_checkpoint(fold_dir / LATEST)
    assert state["epoch"] == 3 and state["finished"]
    # Resume is exact: same per-epoch losses as the run that was never interrupted.
    assert _losses(run) == pytest.approx(_losses(trained_run), rel=1e-5)


def test_sigkill_at_a_random_moment_of_an_epoch(prepared_cache, tmp_path):
    run = tmp_path / "run"
    log = run / "fold_0" / "train.log"
    with ForkedCli(["train", "--run", run, *set_args(prepared_cache, EPOCHS)], cwd=REPO) as process:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            if log.exists() and "epoch 1/3  train_loss" in log.read_text():
                break
            time.sleep(0.02)
        time.sleep(0.3)  # somewhere inside epoch 2 (steps, validation or the checkpoint write)
        assert log.exists(), "training never started"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert_no_half_written_files(run)
    logged_epochs = log.read_text().count(" train_loss ")
    state, _ = load_latest(run / "fold_0")
    assert state["epoch"] >= logged_epochs - 1  # at most the interrupted epoch is lost

    resumed = invoke("train", "--run", run, "--resume", *set_args(prepared_cache, EPOCHS))
    assert resumed.exit_code == 0, resumed.output
    assert load_checkpoint(run / "fold_0" / LATEST)["epoch"] == 3


@pytest.mark.parametrize(
    "kill_at",
    ["BraTS2021_00002:1:before", "index.json:2:before"],
    ids=["case-complete-not-renamed", "before-index-update"],
)
def test_sigkill_during_prepare_then_rerun(phantom_root, tmp_path, kill_at):
    from brats_swap.data.cache import list_prepared, load_prepared

    cache = tmp_path / "cache"
    args = ["data", "prepare", phantom_root, "--out", cache, "--workers", "1", "--set", "data.cube=[32,32,32]"]
    killed = run_killed_at(args, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert_no_half_written_files(cache)
    for case_id in list_prepared(cache):  # whatever is listed is complete
        prepared = load_prepared(cache, case_id, mmap=False)
        assert prepared.image.shape[1:] == (32, 32, 32)

    rerun = invoke(*args)
    assert rerun.exit_code == 0, rerun.output
    counts = re.search(r":(\d+)prepared,(\d+)uptodate", squash(rerun.output))
    assert int(counts[2]) >= 1, rerun.output  # cases finished before the kill are not redone
    assert len(list_prepared(cache)) == 4
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".")]  # stale temp folders removed
    assert_no_half_written_files(cache)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupted_latest_checkpoint_falls_back_to_previous(run_copy, prepared_cache, damage):
    latest = run_copy / "fold_0" / LATEST
    data = bytearray(latest.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 3]
    else:
        data = bytearray()
    latest.write_bytes(bytes(data))

    result = invoke("train", "--run", run_copy, "--resume", *set_args(prepared_cache, "train.max_epochs=4"))
    assert result.exit_code == 0, result.output
    assert says(result.output, "warning:", str(latest), "falling back to checkpoint_prev.pt (epoch 2)")
    state = load_checkpoint(latest)  # rewritten, good again
    assert state["epoch"] == 4


def test_both_checkpoints_corrupted_is_a_clean_error(run_copy, prepared_cache):
    fold_dir = run_copy / "fold_0"
    for name in (LATEST, PREVIOUS):
        path = fold_dir / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    before = {name: (fold_dir / name).read_bytes() for name in (LATEST, PREVIOUS)}
    result = invoke("train", "--run", run_copy, "--resume", *set_args(prepared_cache, "train.max_epochs=4"))
    line = error_line(result, EXIT_BAD_INPUT, PREVIOUS)
    assert "checksum mismatch" in line or "unreadable checkpoint" in line
    assert {name: (fold_dir / name).read_bytes() for name in (LATEST, PREVIOUS)} == before  # nothing overwritten


def test_corrupted_best_checkpoint_on_evaluate(run_copy, phantom_root):
    best = run_copy / "fold_0" / BEST
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0x01
    best.write_bytes(bytes(data))
    result = invoke("evaluate", "--run", run_copy, "--fold", "0", "--data", phantom_root)
    error_line(result, EXIT_BAD_INPUT, str(best), "corrupted")
    assert not (run_copy / "fold_0" / "predictions").exists()


def test_not_a_checkpoint(run_copy, phantom_root):
    best = run_copy / "fold_0" / BEST
    best.write_text("hello")
    result = invoke("evaluate", "--run", run_copy, "--fold", "0", "--data", phantom_root)
    error_line(result, EXIT_BAD_INPUT, str(best), "checkpoint")


def test_ctrl_c_mid_epoch_saves_exits_130_and_resumes_exactly(prepared_cache, trained_run, tmp_path, monkeypatch):
    import os

    from failure_helpers import loss_with_fault

    from brats_swap.train import loop

    def ctrl_c(loss, probs):
        os.kill(os.getpid(), signal.SIGINT)  # as if the user pressed Ctrl-C during this step
        return loss

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_fault(ctrl_c, at_step=3))  # epoch 2, step 1
    run = tmp_path / "run"
    result = invoke("train", "--run", run, *set_args(prepared_cache, EPOCHS))
    error_line(result, 130, "SIGINT at epoch 2 step 1", "--resume")
    state = load_checkpoint(run / "fold_0" / LATEST)
    assert (state["epoch"], state["step_in_epoch"]) == (1, 1)  # the finished step is kept

    monkeypatch.undo()
    resumed = invoke("train", "--run", run, "--resume", *set_args(prepared_cache, EPOCHS))
    assert resumed.exit_code == 0, resumed.output
    assert _losses(run) == pytest.approx(_losses(trained_run), rel=1e-5)


def test_ctrl_c_under_cv_run_says_to_rerun_the_same_command(prepared_cache, phantom_root, tmp_path, monkeypatch):
    import os

    from failure_helpers import loss_with_fault

    from brats_swap.train import loop

    def ctrl_c(loss, probs):
        os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_fault(ctrl_c, at_step=1))
    run = tmp_path / "run"
    args = ["cv", "run", "--run", run, *set_args(prepared_cache, "train.max_epochs=1", f"data.root={phantom_root}")]
    result = invoke(*args)
    error_line(result, 130, "SIGINT at epoch 1 step 1", "run the same command again")
    assert "--resume" not in result.output  # that is train's spelling; cv resumes by itself
    assert (run / "fold_0" / LATEST).exists()


def test_a_second_train_on_a_locked_run_exits_75(prepared_cache, tmp_path):
    from brats_swap.cv.lock import run_lock

    run = tmp_path / "run"
    with run_lock(run):  # another brats-swap process (e.g. tonight's cron job) works on this run
        result = invoke("train", "--run", run, *set_args(prepared_cache, "train.max_epochs=1"))
    error_line(result, 75, str(run), "another brats-swap process")
    assert not (run / "fold_0").exists()


def test_sigkill_during_cv_then_rerun(prepared_cache, phantom_root, tmp_path):
    """cv (2 folds, 1 epoch each) killed right after fold 0's evaluation report landed: the re-run trains and
    evaluates only what is missing and writes the summary."""
    import json

    run = tmp_path / "run"
    args = ["cv", "--run", run, *set_args(prepared_cache, "train.max_epochs=1", f"data.root={phantom_root}")]
    killed = run_killed_at(args, "summary.json:1:after")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert_no_half_written_files(run)
    assert (run / "fold_0" / "summary.json").exists() and not (run / "fold_1" / LATEST).exists()

    fold_0_checkpoint = (run / "fold_0" / LATEST).read_bytes()
    rerun = invoke(*args)
    assert rerun.exit_code == 0, rerun.output
    assert_no_half_written_files(run)
    summary = json.loads((run / "cv_summary.json").read_text())
    assert summary["complete"] is True
    log = (run / "cv.log").read_text().splitlines()
    assert len(log) == 1 and "exit 0" in log[0]  # the killed invocation could not log; the re-run did
    assert (run / "fold_0" / LATEST).read_bytes() == fold_0_checkpoint  # fold 0 was not retrained
