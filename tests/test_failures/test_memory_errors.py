"""Exhausted memory: a device out-of-memory error during training is exit 3 with the planner's advice for
this model, size and device, and the last good checkpoint is kept; in validation's prediction it is the same
one line, failed.txt and exit 3 with the prediction's own advice; anywhere else (evaluation) it is still one
line and exit 3. A prepared cache that would not fit on the disk is refused before
anything is written.
"""

from __future__ import annotations

from collections import namedtuple

import torch
from failure_helpers import error_line, invoke, loss_with_fault, set_args

from brats_swap.errors import EXIT_BAD_INPUT, EXIT_OUT_OF_MEMORY
from brats_swap.run.checkpoint import load_checkpoint
from brats_swap.run.folder import LATEST
from brats_swap.train import loop, planning

CUDA_OOM = "CUDA out of memory. Tried to allocate 13.50 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError(CUDA_OOM)


def test_oom_in_a_training_step_gives_the_planners_advice(prepared_cache, tmp_path, monkeypatch):
    def out_of_memory(loss, probs):
        _raise_oom()

    monkeypatch.setattr(loop, "weighted_dice_loss", loss_with_fault(out_of_memory, at_step=3))
    run = tmp_path / "run"
    result = invoke("train", "--run", run, *set_args(prepared_cache, "train.max_epochs=3"))
    line = error_line(result, EXIT_OUT_OF_MEMORY, "epoch 2 step 1", "ran out of memory",
                      "memory.mode=none", "--set memory.mode=auto")
    # The advice is for this model and size: what the current policy needs, from the planner.
    assert "needs" in line and "GiB" in line, line
    assert load_checkpoint(run / "fold_0" / LATEST)["epoch"] == 1  # the last good checkpoint is kept


def test_oom_during_validation_is_a_training_steps_line_failed_txt_and_exit_3(prepared_cache, tmp_path, monkeypatch):
    """Validation's prediction running out of memory ends the fold as a training step's does: one line naming the
    fold, the epoch and what was predicted, written to failed.txt and train.log too, exit 3, no traceback."""
    monkeypatch.setattr(loop, "predict_cube", _raise_oom)
    run = tmp_path / "run"
    result = invoke("train", "--run", run, *set_args(prepared_cache, "train.max_epochs=2", "train.val_every=2"))
    line = error_line(result, EXIT_OUT_OF_MEMORY, "fold_0: epoch 2 validation: cpu ran out of memory",
                      "predicting the whole cube", "data.cube")
    message = line.removeprefix("error:").strip()
    assert (run / "fold_0" / "failed.txt").read_text() == message + "\n"
    assert f"error: {message}" in (run / "fold_0" / "train.log").read_text()
    assert load_checkpoint(run / "fold_0" / LATEST)["epoch"] == 1  # the last good checkpoint is kept


def test_oom_during_evaluation_is_exit_3(run_copy, phantom_root, monkeypatch):
    from brats_swap.evaluate import predicting

    monkeypatch.setattr(predicting, "predict_cube", _raise_oom)
    result = invoke("evaluate", "--run", run_copy, "--fold", "0", "--data", phantom_root)
    error_line(result, EXIT_OUT_OF_MEMORY, "evaluate", "ran out of memory", "memory.mode=auto")


def test_host_memory_error_is_exit_3(run_copy, phantom_root, monkeypatch):
    from brats_swap.evaluate import predicting

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(predicting, "predict_cube", no_memory)
    result = invoke("evaluate", "--run", run_copy, "--fold", "0", "--data", phantom_root)
    error_line(result, EXIT_OUT_OF_MEMORY, "host ran out of memory")


def test_cache_larger_than_free_disk_is_refused_before_writing(phantom_root, tmp_path, monkeypatch):
    from brats_swap.data import cache as cache_module

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    cache = tmp_path / "cache"
    # At the default 192³ float16 cube, 4 cases need ~0.2 GiB; 1 MiB is free.
    result = invoke("data", "prepare", phantom_root, "--out", cache, "--workers", "1")
    error_line(result, EXIT_BAD_INPUT, str(cache), "4 cases needs about", "GiB", "free")
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name != "index.json"]


def test_oom_advice_names_the_device_and_policy(prepared_cache):
    """The advice itself, without training: names device, current policy and what it needs."""
    from failure_helpers import tiny_config

    config = tiny_config(prepared_cache)
    error = planning.out_of_memory_error(torch.device("cpu"), config, "fold_0: epoch 1 step 1")
    message = str(error)
    assert error.exit_code == EXIT_OUT_OF_MEMORY
    assert message.startswith("fold_0: epoch 1 step 1: cpu ran out of memory")
    assert "memory.mode=none" in message and "needs" in message and "--set memory.mode=auto" in message
