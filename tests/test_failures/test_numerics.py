"""Numerics: a NaN/Inf loss stops training with one line naming the step (exit 1) and keeps the last good
checkpoint; an fp16 overflow in the scaled gradients is the GradScaler's business (the step is skipped and
the scale lowered), not a crash.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from failure_helpers import error_line, invoke, loss_with_fault, set_args

from brats_swap.errors import EXIT_BAD_INPUT
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST
from brats_swap.train import loop


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_loss_stops_training_and_keeps_the_last_checkpoint(prepared_cache, tmp_path, monkeypatch, bad):
    run = tmp_path / "run"
    # 2 training steps per epoch: step 3 is epoch 2, step 1.
    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_fault(lambda loss, probs: loss + bad, at_step=3))
    result = invoke("train", "--run", run, *set_args(prepared_cache, "train.max_epochs=3"))
    error_line(result, EXIT_BAD_INPUT, f"loss is {bad}", "epoch 2 step 1", "last good checkpoint is kept")

    state = load_checkpoint(run / "fold_0" / LATEST)
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())

    monkeypatch.undo()  # the cause is gone (e.g. a lower lr): the run continues from the kept checkpoint
    resumed = invoke("train", "--run", run, "--resume", *set_args(prepared_cache, "train.max_epochs=3"))
    assert resumed.exit_code == 0, resumed.output
    assert load_checkpoint(run / "fold_0" / LATEST)["epoch"] == 3


def test_nan_input_is_caught_as_a_bad_loss(writable_cache, tmp_path):
    # A prepared case damaged after `prepare` (e.g. bit rot): NaN voxels reach the network.
    from brats_swap.data.cache import IMAGE_FILE, list_prepared, load_prepared
    from brats_swap.data.compressed import write_volume

    for case_id in list_prepared(writable_cache):
        image = load_prepared(writable_cache, case_id).image  # its stored box, rewritten as NaN
        write_volume(writable_cache / case_id / IMAGE_FILE,
                     np.full((*image.shape[:-3], *(b - a for a, b in image.box)), np.nan, image.dtype))
    run = tmp_path / "run"
    result = invoke("train", "--run", run, *set_args(writable_cache, "train.max_epochs=2"))
    error_line(result, EXIT_BAD_INPUT, "loss is nan", "epoch 1 step 1")
    assert not (run / "fold_0" / LATEST).exists()  # nothing good to keep yet, and nothing bad written


def test_fp16_overflow_is_a_skipped_step_not_a_crash(prepared_cache, tmp_path, monkeypatch):
    """Gradients that overflow once scaled (the loss itself is finite): GradScaler skips that optimiser
    step and halves its scale; training goes on."""

    def overflowing_gradients(loss, probs):
        # Adds exactly zero to the loss value but 1e36 to one gradient: inf once multiplied by the scale.
        bomb = probs.float().flatten()[0] * 1e36
        return loss + (bomb - bomb.detach())

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_fault(overflowing_gradients, at_step=2))
    # A CPU trains fp16 configs in bf16 (run.device.amp_on_device), which needs no scaler: keep fp16 here, where
    # the GradScaler is what is tested (on a GPU fp16 runs as asked).
    from brats_swap.run import device as run_device

    for module in (loop, run_device):
        monkeypatch.setattr(module, "amp_on_device", lambda amp, device: (amp, None))
    run = tmp_path / "run"
    result = invoke("train", "--run", run, *set_args(prepared_cache, "train.max_epochs=1", "train.amp=fp16"))
    assert result.exit_code == 0, result.output
    state = load_checkpoint(run / "fold_0" / LATEST)
    assert state["epoch"] == 1 and math.isfinite(state["history"][0]["train_loss"])
    assert state["scaler"]["scale"] == 65536.0 / 2  # exactly one skipped step
    assert all(torch.isfinite(v).all() for v in state["model"].values())
