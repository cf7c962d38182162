"""The training recipe end to end on tiny phantoms (16³ cubes: what is checked here holds at any size): run
folder, determinism, exact resume, failures."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml
from train_helpers import SMALL, small_dataset, tensorboard_scalars, tiny_config

from brats_swap.errors import ConfigError, NumericalError, TrainingInterrupted
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import BEST, LATEST, PREVIOUS
from brats_swap.train import loop
from brats_swap.train.loop import train_fold


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


def small_config(data, *overrides: str):
    return tiny_config(*data, *SMALL, *overrides)


@pytest.fixture(scope="module")
def two_epoch_run(data, tmp_path_factory):
    """The reference: 2 uninterrupted epochs of 2 steps."""
    run = tmp_path_factory.mktemp("ref") / "run"
    result = train_fold(small_config(data, "train.max_epochs=2"), run, 0, progress=False)
    return run, result


def losses(result):
    return [(r["train_loss"], r["val_loss"]) for r in result.history]


def test_one_epoch_writes_the_run_folder_contract(data, tmp_path):
    run = tmp_path / "run"
    config = small_config(data)
    result = train_fold(config, run, 0, progress=False)

    assert result.finished and result.epochs_completed == 1 and not result.interrupted
    assert result.best_epoch == 1 and 0.0 <= result.best_val_dice <= 1.0
    assert len(result.epoch_seconds) == 1 and result.peak_memory_bytes > 0
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["base_filters"] == 4
    env = json.loads((run / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert json.loads((run / "fold_0" / "env.json").read_text()) == env  # the fold's own record
    splits = json.loads((run / "splits.json").read_text())
    assert len(splits["folds"]) == 2
    fold = run / "fold_0"
    log = (fold / "train.log").read_text()
    assert "epoch 1/1" in log and "dice_wt" in log
    scalars = tensorboard_scalars(fold / "tb")
    for tag in ("train/loss", "val/loss", "val/dice_wt", "val/dice_tc", "val/dice_et", "lr", "memory/peak_gib",
                "time/step_s"):
        assert len(scalars[tag]) == 1, tag
    state = load_checkpoint(fold / LATEST)
    for key in ("model", "optimizer", "scheduler", "scaler", "rng", "config", "epoch", "best_val_dice",
                "last_improved_epoch", "history"):
        assert key in state, key
    assert state["epoch"] == 1 and state["finished"]
    assert set(state["rng"]) >= {"torch", "numpy", "python", "cuda", "loader"}
    assert load_checkpoint(fold / BEST)["best_epoch"] == 1
    # Resuming a finished fold is a no-op; training it again without --resume is refused.
    again = train_fold(config, run, 0, resume=True, progress=False)
    assert again.finished and again.epochs_completed == 1 and again.epoch_seconds == []
    with pytest.raises(ConfigError, match="--resume"):
        train_fold(config, run, 0, progress=False)
    # Each fold keeps the record of its own training; the run's env.json is the fold trained last.
    fold_0_env = (fold / "env.json").read_text()
    train_fold(config, run, 1, progress=False)
    assert (fold / "env.json").read_text() == fold_0_env
    assert json.loads((run / "fold_1" / "env.json").read_text()) == json.loads((run / "env.json").read_text())


def test_two_runs_of_one_config_give_identical_losses(data, two_epoch_run, tmp_path):
    _, reference = two_epoch_run
    again = train_fold(small_config(data, "train.max_epochs=2"), tmp_path / "run", 0, progress=False)
    assert losses(again) == losses(reference)
    other_seed = train_fold(small_config(data, "train.max_epochs=1", "seed=1"), tmp_path / "seed1", 0, progress=False)
    assert losses(other_seed)[0] != losses(reference)[0]


def test_resume_at_an_epoch_boundary_continues_exactly(data, two_epoch_run, tmp_path):
    _, reference = two_epoch_run
    config = small_config(data, "train.max_epochs=2")
    calls = []

    def stop_after_first_epoch() -> bool:
        calls.append(1)
        return len(calls) > 1

    first = train_fold(config, tmp_path / "run", 0, stop_requested=stop_after_first_epoch, progress=False)
    assert first.interrupted and not first.finished and first.epochs_completed == 1
    resumed = train_fold(config, tmp_path / "run", 0, resume=True, progress=False)
    assert resumed.finished and resumed.epochs_completed == 2
    assert losses(resumed) == losses(reference)


def test_ctrl_c_mid_epoch_saves_and_resume_gives_the_same_next_steps(data, two_epoch_run, tmp_path, monkeypatch):
    _, reference = two_epoch_run
    config = small_config(data, "train.max_epochs=2")
    real_loss = loop.weighted_dice_loss
    step_losses: list[float] = []

    def loss_with_ctrl_c(probs, target):
        loss = real_loss(probs, target)
        if torch.is_grad_enabled():  # training steps only (validation runs under no_grad)
            step_losses.append(float(loss.detach()))
            if len(step_losses) == 3:  # epoch 2, step 1: as if the user pressed Ctrl-C during it
                os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_ctrl_c)
    with pytest.raises(TrainingInterrupted, match="epoch 2 step 1"):
        train_fold(config, tmp_path / "run", 0, progress=False)
    saved = load_checkpoint(tmp_path / "run" / "fold_0" / LATEST)
    assert (saved["epoch"], saved["step_in_epoch"]) == (1, 1)

    monkeypatch.setattr(loop, "weighted_dice_loss", real_loss)
    resumed_losses: list[float] = []

    def recording_loss(probs, target):
        loss = real_loss(probs, target)
        if torch.is_grad_enabled():
            resumed_losses.append(float(loss.detach()))
        return loss

    monkeypatch.setattr(loop, "weighted_dice_loss", recording_loss)
    resumed = train_fold(config, tmp_path / "run", 0, resume=True, progress=False)
    # The step after the interruption (epoch 2 step 2) has the uninterrupted run's loss, and so does the epoch.
    assert resumed_losses == [pytest.approx(reference.history[1]["train_loss"] * 2 - step_losses[2], rel=1e-6)]
    assert losses(resumed) == losses(reference)


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(data, two_epoch_run, tmp_path, capsys):
    run, reference = two_epoch_run
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(run, copy)
    latest = copy / "fold_0" / LATEST
    raw = bytearray(latest.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte inside the payload
    latest.write_bytes(bytes(raw))
    assert (copy / "fold_0" / PREVIOUS).exists()

    resumed = train_fold(small_config(data, "train.max_epochs=2"), copy, 0, resume=True, progress=False)
    err = capsys.readouterr().err
    assert "checkpoint_latest.pt" in err and "falling back to checkpoint_prev.pt" in err
    # prev held epoch 1, so epoch 2 was trained again, exactly as the first time.
    assert resumed.epochs_completed == 2 and resumed.epoch_seconds and losses(resumed) == losses(reference)


def test_nan_loss_stops_with_a_numerical_error_and_keeps_the_checkpoint(data, two_epoch_run, tmp_path, monkeypatch):
    run, _ = two_epoch_run
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = (copy / "fold_0" / LATEST).read_bytes()
    monkeypatch.setattr(loop, "weighted_dice_loss", lambda probs, target: probs.sum() * float("nan"))
    with pytest.raises(NumericalError, match="epoch 3 step 1"):
        train_fold(small_config(data, "train.max_epochs=3"), copy, 0, resume=True, progress=False)
    assert (copy / "fold_0" / LATEST).read_bytes() == before


def test_resume_warns_about_changed_config_keys(data, two_epoch_run, tmp_path, capsys):
    run, _ = two_epoch_run
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    result = train_fold(small_config(data, "train.max_epochs=3", "train.lr=0.002"), copy, 0, resume=True,
                        progress=False)
    err = " ".join(capsys.readouterr().err.split())
    assert "train.max_epochs" in err and "train.lr" in err
    assert result.epochs_completed == 3 and len(result.epoch_seconds) == 1


def test_patch_mode_trains_and_validates_with_a_sliding_window(data, tmp_path):
    config = small_config(data, "train.mode=patch", "train.patch=[8,8,8]", "train.patches_per_case=2",
                          # 3 levels: the bottleneck of an 8³ patch stays 2³
                          "model.depth=3", "model.segmentation_levels=2")
    result = train_fold(config, tmp_path / "run", 0, progress=False)
    assert result.finished and "dice_et" in result.history[0]
    assert "mode patch [8, 8, 8]" in (tmp_path / "run" / "fold_0" / "train.log").read_text()
