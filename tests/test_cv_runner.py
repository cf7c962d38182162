"""The cv runner's logic with a scripted training loop (fast): resume, window, SIGTERM, lock, idempotence.

tests/test_cv_integration.py repeats the crucial cases with the real training loop, in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import statistics

import pytest
from cv_helpers import CASE_IDS, epochs_trained, fake_dice, install_fake_training, snapshot

from brats_swap import splits
from brats_swap.config import load_config
from brats_swap.cv.dispatch import run_cv
from brats_swap.cv.lock import run_lock
from brats_swap.cv.runner import resolve_folds
from brats_swap.cv.stop_control import StopControl
from brats_swap.errors import ConfigError, DataError, RunLockedError


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return install_fake_training(monkeypatch, tmp_path)


@pytest.fixture
def config(tmp_path):
    return load_config(None, [f"data.cache={tmp_path / 'cache'}", "cv.folds=3", "train.max_epochs=3",
                              "name=fake"])


def test_a_full_run_trains_and_evaluates_every_fold_and_summarises(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    outcome = run_cv(config, run_dir)
    assert outcome.complete and outcome.exit_code == 0 and outcome.stop_reason is None
    assert outcome.started == [0, 1, 2] and outcome.evaluated == [0, 1, 2]
    assert fake.calls == [(0, False), (1, False), (2, False)]
    for k in range(3):
        assert epochs_trained(run_dir, k) == [1, 2, 3]
        state = json.loads((run_dir / f"fold_{k}" / "state.json").read_text())
        assert state["trained"] and state["evaluated"] and state["epochs_completed"] == 3

    summary = json.loads((run_dir / "cv_summary.json").read_text())
    assert summary["complete"] and summary["folds_done"] == [0, 1, 2]
    # 6 cases in 3 folds: 2 validation cases per fold; mean ± std over the per-fold means.
    fold_means = [statistics.fmean([fake_dice(k, 0), fake_dice(k, 1)]) for k in range(3)]
    cell = summary["table"]["dice"]["WT"]
    assert cell["mean"] == pytest.approx(statistics.fmean(fold_means))
    assert cell["std"] == pytest.approx(statistics.stdev(fold_means))
    assert summary["table"]["dice"]["TC"]["std"] == pytest.approx(0.0)
    # An undefined HD95 (inf) is left out of the mean rather than poisoning it.
    assert summary["table"]["hd95"]["WT"]["mean"] == pytest.approx(3.0)
    assert "specificity" not in summary["table"]  # columns that metrics.csv lacks are not invented
    markdown = (run_dir / "cv_summary.md").read_text()
    assert f"{statistics.fmean(fold_means):.3f} ± {statistics.stdev(fold_means):.3f}" in markdown
    assert (run_dir / "figures" / "dice_boxplot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (run_dir / "cv.log").read_text().splitlines()
    assert len(log) == 1 and "exit 0" in log[0] and "all 3 fold(s) done" in log[0]


def test_max_hours_stops_at_an_epoch_boundary_and_the_next_call_continues(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    now = [0.0]

    def one_minute_epochs(fold, epoch):
        now[0] += 60.0

    fake.during_epoch = one_minute_epochs
    # A 90 s window: after epoch 1 (60 s) another would end at 120 s, so the runner stops there.
    first = run_cv(config, run_dir, max_hours=90 / 3600, clock=lambda: now[0])
    assert first.stopped and first.stop_reason == "max-hours" and first.exit_code == 0
    assert epochs_trained(run_dir, 0) == [1]
    assert json.loads((run_dir / "fold_0" / "checkpoint_latest.pt").read_text()) == {"epoch": 1, "finished": False, "history": [
        {"epoch": 1, "train_loss": 1.0, "val_dice_mean": 0.2, "epoch_s": 0.5}]}
    assert not (run_dir / "fold_1").exists()
    assert "--max-hours window closed" in (run_dir / "cv.log").read_text()
    summary = json.loads((run_dir / "cv_summary.json").read_text())
    assert not summary["complete"] and [f["status"] for f in summary["folds"]] == ["stopped", "not started", "not started"]

    second = run_cv(config, run_dir)
    assert second.complete and second.resumed == [0] and second.started == [1, 2]
    assert fake.calls == [(0, False), (0, True), (1, False), (2, False)]
    assert epochs_trained(run_dir, 0) == [1, 2, 3]  # nothing trained twice
    state = json.loads((run_dir / "fold_0" / "state.json").read_text())
    assert state["invocations"] == 2 and state["epoch_seconds"] == [0.5, 0.5, 0.5]


def test_the_window_is_respected_using_the_last_epoch_length():
    now = [0.0]
    stop = StopControl(max_hours=10 / 3600, clock=lambda: now[0])
    now[0] = 1.0
    assert not stop()  # first boundary: no epoch length known yet
    now[0] = 5.0
    assert not stop()  # epoch took 4 s, the next would end at 9 s < 10 s
    now[0] = 8.0
    assert stop()  # epoch took 3 s: the next would end at 11 s, past the 10 s window, so stop now
    assert stop.reason == "max-hours"


def test_sigterm_stops_at_the_next_epoch_boundary_and_the_handler_is_restored(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    previous = signal.getsignal(signal.SIGTERM)

    def send_sigterm(fold, epoch):
        if (fold, epoch) == (1, 2):
            os.kill(os.getpid(), signal.SIGTERM)

    fake.during_epoch = send_sigterm
    outcome = run_cv(config, run_dir)
    assert outcome.stop_reason == "SIGTERM" and outcome.exit_code == 0 and not outcome.complete
    assert outcome.done == [0] and epochs_trained(run_dir, 1) == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is previous
    assert "SIGTERM received" in (run_dir / "cv.log").read_text()
    fake.during_epoch = None
    assert run_cv(config, run_dir).complete
    assert epochs_trained(run_dir, 1) == [1, 2, 3]


def test_a_completed_run_reinvoked_changes_nothing_but_the_summary_timestamp(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    run_cv(config, run_dir)
    volatile = ("cv.log", ".lock", "cv_summary.json", "cv_summary.md")
    before = snapshot(run_dir, ignore=volatile)
    summary_before = json.loads((run_dir / "cv_summary.json").read_text())
    markdown_before = (run_dir / "cv_summary.md").read_text()
    fake.calls.clear()
    outcome = run_cv(config, run_dir)
    assert outcome.complete and outcome.exit_code == 0
    assert fake.calls == [] and fake.evaluations == [0, 1, 2]  # evaluations are from the first call
    assert snapshot(run_dir, ignore=volatile) == before  # states, metrics, checkpoints and the figure
    summary_after = json.loads((run_dir / "cv_summary.json").read_text())
    summary_before.pop("generated_at"), summary_after.pop("generated_at")
    assert summary_after == summary_before
    strip = lambda text: [line for line in text.splitlines() if not line.startswith("Summary written")]  # noqa: E731
    assert strip((run_dir / "cv_summary.md").read_text()) == strip(markdown_before)
    log = (run_dir / "cv.log").read_text().splitlines()
    assert len(log) == 2 and "nothing to train or evaluate" in log[1]


def test_a_locked_run_raises_at_once_and_touches_nothing(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    run_cv(config, run_dir, folds=0)
    before = snapshot(run_dir, ignore=(".lock",))
    with run_lock(run_dir):
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}") as error:
            run_cv(config, run_dir)
        assert error.value.exit_code == 75
    assert snapshot(run_dir, ignore=(".lock",)) == before
    assert fake.calls == [(0, False)]


def test_a_window_already_closed_trains_nothing_and_exits_cleanly(fake, config, tmp_path):
    outcome = run_cv(config, tmp_path / "run", max_hours=1e-9)
    assert outcome.stop_reason == "max-hours" and outcome.exit_code == 0 and fake.calls == []


def test_the_lock_is_released_after_an_error(fake, config, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(splits, "list_prepared", lambda cache: [])
    with pytest.raises(DataError, match="no prepared cases"):
        run_cv(config, run_dir)
    assert "exit 1 (DataError" in (run_dir / "cv.log").read_text()
    with run_lock(run_dir):  # would raise RunLockedError if the failed call had kept it
        pass


def test_a_fold_killed_after_training_but_before_its_state_is_recorded_is_not_retrained(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    run_cv(config, run_dir, folds=0)
    (run_dir / "fold_0" / "state.json").unlink()  # as if SIGKILLed between train_fold and the state write
    outcome = run_cv(config, run_dir, folds=0)
    assert outcome.complete and fake.calls[-1] == (0, True)
    assert epochs_trained(run_dir, 0) == [1, 2, 3]


def test_fold_selection():
    assert resolve_folds("all", 5) == [0, 1, 2, 3, 4]
    assert resolve_folds("3", 5) == [3]
    assert resolve_folds([2, 0, 2], 5) == [0, 2]
    with pytest.raises(ConfigError, match="--fold 5"):
        resolve_folds(5, 5)
    with pytest.raises(ConfigError, match="'x'"):
        resolve_folds("x", 5)


def test_a_hand_edited_split_is_used_by_the_runner(fake, config, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    edited = {"seed": 0, "folds": [{"train": CASE_IDS[1:], "val": CASE_IDS[:1]},
                                   {"train": CASE_IDS[:1], "val": CASE_IDS[1:]}]}
    (run_dir / "splits.json").write_text(json.dumps(edited))
    outcome = run_cv(config, run_dir)  # cv.folds=3 in the config, but the run's file has 2 folds
    assert outcome.folds == [0, 1] and outcome.complete
    summary = json.loads((run_dir / "cv_summary.json").read_text())
    assert [f["val_cases"] for f in summary["folds"]] == [1, 5]


def test_stop_control_without_a_window_only_stops_on_request():
    stop = StopControl(None)
    assert not stop() and not stop.time_is_up()
    stop.request("SIGTERM")
    assert stop() and stop.reason == "SIGTERM"



def test_the_one_entry_refuses_parallel_folds_it_cannot_run(fake, config, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="--parallel-folds 0: must be at least 1"):
        run_cv(config, run_dir, parallel_folds=0)
    with pytest.raises(ValueError, match="time.monotonic"):
        run_cv(config, run_dir, parallel_folds=2, clock=lambda: 0.0)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)  # as under torchrun: there every fold already trains on all ranks
    with pytest.raises(ConfigError, match="--parallel-folds: not under torchrun"):
        run_cv(config, run_dir, parallel_folds=2)
    assert not run_dir.exists() and fake.calls == []


def test_a_call_on_some_folds_summarises_every_fold_and_is_complete_only_when_all_are_done(fake, config, tmp_path):
    # Issue 54, point 1: `cv run --folds 0,1` on a 3-fold run wrote "complete": true over folds 0 and 1 alone,
    # and a later `--folds 1` summarised fold 1 only.
    run_dir = tmp_path / "run"
    assert run_cv(config, run_dir, folds=[0, 1]).complete  # the call's own folds: done
    summary = json.loads((run_dir / "cv_summary.json").read_text())
    assert not summary["complete"] and summary["folds_done"] == [0, 1]
    assert [(f["fold"], f["status"]) for f in summary["folds"]] == [(0, "done"), (1, "done"), (2, "not started")]
    markdown = (run_dir / "cv_summary.md").read_text()
    assert "2 of 3 folds trained and evaluated; fold 2 not yet" in markdown
    assert "mean ± std over 2 folds of 3" in markdown

    run_cv(config, run_dir, folds=[1])  # nothing to do: the summary still covers every fold
    again = json.loads((run_dir / "cv_summary.json").read_text())
    assert [f["fold"] for f in again["folds"]] == [0, 1, 2] and again["folds_done"] == [0, 1]
    assert not again["complete"] and again["table"] == summary["table"]

    run_cv(config, run_dir, folds=[2])
    final = json.loads((run_dir / "cv_summary.json").read_text())
    assert final["complete"] and final["folds_done"] == [0, 1, 2]


def test_a_case_prepared_after_the_folds_were_made_is_named_with_how_to_include_it(fake, config, tmp_path,
                                                                                      monkeypatch, capsys):
    """Issue 54: a case fixed after splits.json was written was prepared but never used, without a word."""
    run_dir = tmp_path / "run"
    run_cv(config, run_dir, folds=[0])
    assert "in no fold" not in capsys.readouterr().err
    monkeypatch.setattr(splits, "list_prepared", lambda cache: [*CASE_IDS, "BraTS2021_00099"])
    run_cv(config, run_dir, folds=[0])
    said = " ".join(capsys.readouterr().err.split())
    assert f"{run_dir / 'splits.json'}: 1 prepared case(s) with a segmentation are in no fold (BraTS2021_00099)" in said
    assert "add each to one fold's \"val\" list and to the other folds' \"train\" lists" in said
