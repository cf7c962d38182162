"""What a new user sees in the first hour: fp16 on a CPU, progress in a log file, the two losses' names, and the
summary of an interrupted run."""

from __future__ import annotations

import io
import json
import math
import os
import signal

import pytest
import torch
from rich.console import Console
from train_helpers import SMALL, small_dataset, tensorboard_scalars, tiny_config

from brats_swap.progress import ProgressLines
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.device import autocast_context
from brats_swap.run.folder import LATEST
from brats_swap.train import loop
from brats_swap.train.loop import train_fold
from brats_swap.train.summary import summary_panel


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)


def _text(renderable) -> str:
    out = Console(file=io.StringIO(), width=300)
    out.print(renderable)
    return out.file.getvalue()


def test_fp16_on_a_cpu_trains_in_bf16_says_so_in_one_line_and_the_run_records_it(data, tmp_path, capsys):
    with autocast_context(torch.device("cpu"), "fp16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    run = tmp_path / "run"
    # Two steps: the second is the first to use weights updated from bf16 gradients, the step whose loss
    # was NaN after a long session when the bottleneck's weight gradients were oneDNN's
    # (tests/test_run_device.py).
    result = train_fold(tiny_config(*data, *SMALL, "train.amp=fp16"), run, 0, progress=False)
    assert result.finished and math.isfinite(result.history[-1]["train_loss"])
    # The lines about the amp setting (the run's path holds "fp16" too, so match the key, not the word).
    warnings = [line for line in capsys.readouterr().err.splitlines() if "train.amp" in line]
    assert len(warnings) == 1 and "bf16" in warnings[0] and "CPU" in warnings[0]
    saved = load_checkpoint(run / "fold_0" / LATEST)
    assert saved["config"]["train"]["amp"] == "bf16"
    assert saved["scaler"] == {}  # no loss scaling: bf16 does not underflow as fp16 does
    assert json.loads((run / "env.json").read_text())["amp"] == "bf16"
    assert "amp bf16" in (run / "fold_0" / "train.log").read_text()


def test_without_a_terminal_an_epoch_prints_progress_lines_before_it_ends(data, tmp_path, capsys):
    train_fold(tiny_config(*data, *SMALL, "train.steps_per_epoch=3"), tmp_path / "run", 0, progress=True)
    out = capsys.readouterr().err.splitlines()  # the console of long work is stderr
    first = next(i for i, line in enumerate(out) if line.startswith("epoch 1/1 step 1/3"))
    assert "elapsed" in out[first] and "s/step" in out[first] and "left in this epoch" in out[first]
    assert "in the run" in out[first]
    assert any(line.startswith("epoch 1/1 ") and "train_loss" in line for line in out[first + 1:])


def test_progress_lines_come_after_the_first_step_and_then_every_interval():
    now = [0.0]
    sink = Console(file=io.StringIO(), width=200)
    lines = ProgressLines("epoch 2/5", 100, console=sink, every_s=60.0, clock=lambda: now[0])
    for step in range(1, 101):
        now[0] += 7.0  # 7 s per step: a line at steps 1, 10, 19, ...; none at the last
        lines.update(step, "loss 0.5")
    printed = sink.file.getvalue().splitlines()
    assert printed[0] == "epoch 2/5 step 1/100, 0:00:07 elapsed, about 0:11:33 left  loss 0.5"
    # issue 44.7: the loop names what "left" counts, and adds the run's (its later steps and validations)
    now[0] = 0.0
    run_lines = ProgressLines("epoch 2/5", 100, console=sink, clock=lambda: now[0], scope="this epoch",
                              rest=("the run", 300, 60.0))
    now[0] = 7.0
    run_lines.update(1, "loss 0.5")
    assert sink.file.getvalue().splitlines()[-1] == ("epoch 2/5 step 1/100, 0:00:07 elapsed, about 0:11:33 left in "
                                                      "this epoch, about 0:47:33 in the run  loss 0.5")
    assert [int(line.split()[3].split("/")[0]) for line in printed] == list(range(1, 100, 9))


def test_a_loss_other_than_validations_is_named_in_the_log_tensorboard_and_summary(data, tmp_path):
    config = tiny_config(*data, *SMALL, "train.loss=dice_bce")
    run = tmp_path / "run"
    result = train_fold(config, run, 0, progress=False)
    epoch_line = next(line for line in (run / "fold_0" / "train.log").read_text().splitlines() if "epoch 1/1  train_loss" in line)
    assert "train_loss(dice_bce) " in epoch_line and "val_loss(dice) " in epoch_line
    assert " train_loss " not in epoch_line and " val_loss " not in epoch_line
    tags = tensorboard_scalars(run / "fold_0" / "tb")
    assert "val/dice_loss" in tags and "val/loss" not in tags and "train/loss" in tags
    panel = _text(summary_panel(result, config))
    assert "train loss(dice_bce)" in panel and "val loss(dice)" in panel


def test_an_interrupted_runs_summary_has_its_peak_and_says_what_a_cpu_peak_measures(data, tmp_path, monkeypatch):
    """SIGUSR1 during the first step: no epoch ended, yet the peak of the steps that ran is reported, and on a
    CPU (the process's resident set) a peak above memory.budget_gib is explained."""
    real_loss = loop.weighted_dice_loss

    def loss_with_signal(probs, target):
        if torch.is_grad_enabled():
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_loss(probs, target)

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_signal)
    config = tiny_config(*data, *SMALL, "train.steps_per_epoch=4", "memory.budget_gib=0.01")
    result = train_fold(config, tmp_path / "run", 0, progress=False)
    assert result.interrupted and result.epochs_completed == 0 and result.peak_memory_bytes > 0.01 * 2**30
    text = _text(summary_panel(result, config))
    assert "peak memory 0.00 GiB" not in text
    assert "CPU: the process's peak resident memory" in text and "above memory.budget_gib 0.01" in text
