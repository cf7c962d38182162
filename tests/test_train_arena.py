"""The trainer sizes the memory engine's host arena from the plan, and a host that cannot hold it stops
training before the first epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import prepared_dataset, tensorboard_scalars
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.config import load_config
from brats_swap.memory import MemoryEngine
from brats_swap.memory import arena as arena_module
from brats_swap.memory.arena import arena_bytes
from brats_swap.memory.planner import Planner
from brats_swap.memory.rulebook import transfer_bytes
from brats_swap.model import build_model
from brats_swap.train import loop, planning
from brats_swap.train.losses import weighted_dice_loss

SWAP_ALL = Path(__file__).resolve().parents[1] / "configs" / "swap_all.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_dataset(tmp_path_factory)


def tiny_sets(data, *extra: str) -> list[str]:
    """32³ cube, 4 base filters, 1 epoch of 1 step on CPU; every saved tensor is large enough to swap."""
    root, cache = data
    return [f"data.root={root}", f"data.cache={cache}", "data.cube=[32,32,32]", "data.loader_workers=0",
            "model.base_filters=4", "train.max_epochs=1", "train.steps_per_epoch=1", "train.device=cpu",
            "cv.folds=2", "evaluate.hd95=false", "name=tiny", "memory.swap.min_bytes=0", *extra]


@pytest.fixture
def engines(monkeypatch):
    """Every engine the trainer builds, with the `arena_bytes` it was given."""
    built: list[tuple[MemoryEngine, int]] = []

    class RecordingEngine(MemoryEngine):
        def __init__(self, *args, arena_bytes: int = 0, **kwargs):
            super().__init__(*args, arena_bytes=arena_bytes, **kwargs)
            built.append((self, arena_bytes))

    monkeypatch.setattr(loop, "MemoryEngine", RecordingEngine)
    return built


@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_the_trainer_passes_the_planned_arena_of_a_swap_preset(data, tmp_path, engines, compress):
    config = load_config(SWAP_ALL, tiny_sets(data, f"memory.swap.compress={compress}"))
    result = loop.train_fold(config, tmp_path / "run", 0, progress=False)
    assert result.finished
    (engine, passed), = engines

    # The planner's prediction for this model, input and policy ...
    shape = planning.training_input_shape(config)
    planner = Planner(build_model(config.model, 3), shape, dtype=torch.float32, loss_fn=weighted_dice_loss)
    predicted = planner.swapped(engine.cfg)
    predicted_bytes = arena_bytes(transfer_bytes(record, engine.cfg.swap) for record in planner.records(engine.cfg)
                                  if record.index in predicted)
    # ... and what the engine really swapped in the step it ran (bf16 halves every fp32 storage on the host).
    swapped = engine.last_swapped()
    swapped_bytes = arena_bytes(transfer_bytes(record, engine.cfg.swap) for record in engine.last_records()
                                if record.index in swapped)
    assert passed > 0 and passed == predicted_bytes == swapped_bytes
    full_size = arena_bytes(record.nbytes for record in engine.last_records() if record.index in swapped)
    assert passed == (full_size if compress == "none" else pytest.approx(full_size / 2, rel=0.01))
    # The arena allocated from the plan was the right size: the step never had to grow it.
    scalars = tensorboard_scalars(tmp_path / "run" / "fold_0" / "tb")
    assert scalars["memory/arena_bytes"] == [float(passed)]


def test_a_mode_that_does_not_swap_passes_no_arena_and_plans_nothing(data, tmp_path, engines, monkeypatch):
    def no_planner(*args, **kwargs):
        raise AssertionError("memory.mode=none must not trace the model for an arena")

    monkeypatch.setattr(planning, "Planner", no_planner)
    config = load_config(None, tiny_sets(data, "memory.mode=none"))
    assert loop.train_fold(config, tmp_path / "run", 0, progress=False).finished
    assert [passed for _, passed in engines] == [0]


def test_a_host_too_small_for_the_arena_stops_training_before_the_first_epoch(data, tmp_path, monkeypatch):
    monkeypatch.setattr(arena_module, "available_host_bytes", lambda: 64 << 10)  # 64 KiB available
    run = tmp_path / "run"
    args = ["train", "--run", str(run), "--config", str(SWAP_ALL)]
    args += [arg for item in tiny_sets(data) for arg in ("--set", item)]
    result = CliRunner().invoke(app, args)

    # ConfigError: the documented exit code 2 (bad config for this host), one error naming the key to change
    # (the console wraps long lines at its width, hence the joined words).
    assert result.exit_code == 2, result.output
    words = " ".join(result.output.split())
    assert words.count("error:") == 1 and "Traceback" not in words, result.output
    assert "error: memory.swap: the host arena needs" in words and "host has 0.00 GiB available" in words
    fold = run / "fold_0"
    # No epoch started: no checkpoint, and train.log holds only the failure's line (which `cv status` shows).
    assert not (fold / "checkpoint_latest.pt").exists()
    log = (fold / "train.log").read_text() if (fold / "train.log").exists() else ""
    assert "epoch" not in log.lower().replace("before the first epoch", ""), log
