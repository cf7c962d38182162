"""Shared pieces of the cv/compare tests: a scripted stand-in for the training loop and the evaluator.

The stand-ins follow the contracts of `train_fold` (resume from `checkpoint_latest.pt`, ask
`stop_requested()` at each epoch boundary, report a TrainResult) and `evaluate_fold` (write the fold's
metrics.csv, one row per validation case) on files small enough to reason about: a JSON "checkpoint" holding the epoch number, one line per trained
epoch in `epochs.log`, and a metrics.csv whose Dice values are known. They let the runner's logic (resume,
lock, window, SIGTERM, idempotence) be tested in milliseconds; tests/test_cv_integration.py runs the
real loop.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.config import Config
from brats_swap.splits import fold_cases, read_splits

CASE_IDS = [f"BraTS2021_{i:05d}" for i in range(6)]
PATCH_PENALTY = 0.05  # the stand-in evaluator scores patch models this much lower on WT Dice


@dataclass
class FakeTrainResult:
    fold: int
    epochs_completed: int
    best_epoch: int | None
    best_val_dice: float | None
    stopped_early: bool
    finished: bool
    interrupted: bool
    train_seconds: float
    epoch_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    history: list[dict] = field(default_factory=list)


@dataclass
class FakeTraining:
    """Counts calls; `during_epoch(fold, epoch)` runs inside each epoch (e.g. to send SIGTERM)."""

    calls: list[tuple[int, bool]] = field(default_factory=list)
    modes: list[tuple[str, str, int]] = field(default_factory=list)  # (train.mode, memory.mode, fold) per call
    evaluations: list[int] = field(default_factory=list)
    during_epoch: object = None

    def train_fold(self, config: Config, run_dir: Path, fold: int = 0, *, resume: bool = False,
                   stop_requested=None) -> FakeTrainResult:
        self.calls.append((fold, resume))
        self.modes.append((config.train.mode, config.memory.mode, fold))
        fold_dir = Path(run_dir) / f"fold_{fold}"
        fold_dir.mkdir(parents=True, exist_ok=True)
        latest = fold_dir / "checkpoint_latest.pt"
        if resume:
            state = json.loads(latest.read_text())
        else:
            assert not latest.exists(), "started a fold from scratch over an existing checkpoint"
            state = {"epoch": 0, "finished": False, "history": []}
        epochs_now: list[float] = []
        while not state["finished"]:
            epoch = state["epoch"] + 1
            if self.during_epoch is not None:
                self.during_epoch(fold, epoch)
            with open(fold_dir / "epochs.log", "a") as handle:
                handle.write(f"{epoch}\n")
            epochs_now.append(0.5)
            history = state["history"] + [{"epoch": epoch, "train_loss": 1.0 / epoch, "val_dice_mean": 0.2 * epoch,
                                           "epoch_s": 0.5}]
            state = {"epoch": epoch, "finished": epoch >= config.train.max_epochs, "history": history}
            latest.write_text(json.dumps(state))
            if not state["finished"] and stop_requested is not None and stop_requested():
                return FakeTrainResult(fold, epoch, epoch, 0.5, False, False, True, sum(epochs_now), epochs_now, 1000,
                                       history)
        return FakeTrainResult(fold, state["epoch"], state["epoch"], 0.5, False, True, False, sum(epochs_now),
                               epochs_now, 1000 + fold, state["history"])

    def evaluate_fold(self, config: Config, run_dir: Path, fold: int, *, checkpoint: str = "best",
                      data_root=None) -> dict:
        self.evaluations.append(fold)
        _, val = fold_cases(read_splits(Path(run_dir) / "splits.json"), fold)
        path = Path(run_dir) / f"fold_{fold}" / "metrics.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["case_id", "dice_wt", "dice_tc", "dice_et", "sensitivity_wt", "hd95_wt"])
            for i, case in enumerate(val):
                dice = fake_dice(fold, i) - (PATCH_PENALTY if config.train.mode == "patch" else 0.0)
                writer.writerow([case, dice, 0.5, 0.25, 0.9, "inf" if i == 0 else 3.0])
        return {"fold": fold}


def fake_dice(fold: int, index: int) -> float:
    return 0.6 + 0.1 * fold + 0.01 * index


def epochs_trained(run_dir: Path, fold: int) -> list[int]:
    path = Path(run_dir) / f"fold_{fold}" / "epochs.log"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def snapshot(run_dir: Path, ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under the run folder, by relative path."""
    run_dir = Path(run_dir)
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and str(p.relative_to(run_dir)) not in ignore
    }


def install_fake_training(monkeypatch, tmp_path: Path) -> FakeTraining:
    """Replace the cv runner's training, evaluation, cache preparation and cache listing by the scripted
    FakeTraining (the cache then holds CASE_IDS, all up to date)."""
    from brats_swap import splits
    from brats_swap.cv import runner
    from brats_swap.data.cache import PrepareReport
    from brats_swap.train import data as train_data

    training = FakeTraining()
    monkeypatch.setattr(runner, "train_fold", training.train_fold)
    monkeypatch.setattr(runner, "evaluate_fold", training.evaluate_fold)
    monkeypatch.setattr(splits, "list_prepared", lambda cache: list(CASE_IDS))
    monkeypatch.setattr(splits, "_has_label", lambda cache, case_id: True)  # the scripted cases are labelled
    monkeypatch.setattr(train_data, "prepare_missing", lambda data_cfg, **_: PrepareReport(
        cache=Path(data_cfg.cache), up_to_date=list(CASE_IDS)))
    (tmp_path / "cache").mkdir()
    return training


def fake_train_command(monkeypatch, prepare: bool = False) -> list:
    """`brats-swap train`'s training (and, unless `prepare`, its data preparation) replaced: the configs it
    would train, in order."""
    from types import SimpleNamespace

    from brats_swap.train import data as train_data
    from brats_swap.train import loop, summary

    trained: list = []

    def train_fold(config, run_dir, fold, resume=False):
        trained.append((config, fold, resume))
        return SimpleNamespace(stop_reason=None, interrupted=False)

    if not prepare:
        monkeypatch.setattr(train_data, "prepare_run_data", lambda data_cfg, **_: None)
    monkeypatch.setattr(loop, "train_fold", train_fold)
    monkeypatch.setattr(summary, "summary_panel", lambda result, config: "")
    return trained
