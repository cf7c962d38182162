"""`brats-swap train` through the CLI: exit codes, memory modes, config on resume."""

from __future__ import annotations

import pytest
from train_helpers import SMALL, small_dataset, tensorboard_scalars
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.train import loop


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return small_dataset(tmp_path_factory)  # the 16³ cube of SMALL: what is checked here holds at any size


def tiny_args(data, run, *extra: str) -> list[str]:
    root, cache = data
    sets = [f"data.root={root}", f"data.cache={cache}", *SMALL, "data.loader_workers=0",
            "model.base_filters=4", "train.max_epochs=1", "train.steps_per_epoch=1", "train.device=cpu",
            "cv.folds=2", "evaluate.hd95=false", "name=tiny", *extra]
    return ["train", "--run", str(run)] + [arg for s in sets for arg in ("--set", s)]


def test_train_cli_trains_then_resume_uses_the_runs_config(data, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(app, tiny_args(data, run))
    assert result.exit_code == 0, result.output
    assert "training summary" in result.output and (run / "fold_0" / "checkpoint_best.pt").exists()
    # --resume without --config reads run/config.yaml; raising max_epochs continues the fold.
    result = CliRunner().invoke(app, ["train", "--run", str(run), "--resume", "--set", "train.max_epochs=2"])
    assert result.exit_code == 0, result.output
    assert "finished after 2 epoch(s)" in " ".join(result.output.split())


def test_nan_loss_exits_1_naming_epoch_and_step(data, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "weighted_dice_loss", lambda probs, target: probs.sum() * float("nan"))
    result = CliRunner().invoke(app, tiny_args(data, tmp_path / "run"))
    assert result.exit_code == 1
    assert "loss is nan at epoch 1 step 1" in " ".join(result.output.split())
    assert not (tmp_path / "run" / "fold_0" / "checkpoint_latest.pt").exists()


@pytest.mark.parametrize("mode", ["swap", "recompute", "hybrid"])
def test_memory_modes_train_and_log_engine_stats(data, tmp_path, mode):
    extra = ["memory.swap.min_bytes=0", "memory.recompute.norm_act=true"]
    result = CliRunner().invoke(app, tiny_args(data, tmp_path / "run", f"memory.mode={mode}", *extra))
    assert result.exit_code == 0, result.output
    scalars = tensorboard_scalars(tmp_path / "run" / "fold_0" / "tb")
    assert scalars["memory/saved_bytes"][0] > 0
    if mode in ("swap", "hybrid"):
        assert scalars["memory/swapped_out_bytes"][0] > 0
    if mode in ("recompute", "hybrid"):
        assert scalars["memory/recomputed_bytes"][0] > 0


def test_memory_mode_auto_saves_the_planners_choice(data, tmp_path):
    import json

    result = CliRunner().invoke(app, tiny_args(data, tmp_path / "run", "memory.mode=auto", "memory.budget_gib=4",
                                               "memory.bandwidth_gbs=10"))
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "run" / "fold_0" / "memory_plan.json").read_text())
    assert plan["memory"]["mode"] in ("none", "swap", "recompute", "hybrid")
    assert plan["input_shape"] == [1, 4, 16, 16, 16]
