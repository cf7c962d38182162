"""Per-fold progress of a cross-validation run: `fold_<k>/state.json`, written atomically.

A fold is *done* when it is trained (the training loop said `finished`) and evaluated (its metrics are
written). The file is a record, not the source of truth for resuming: the training loop resumes from
`checkpoint_latest.pt`, so a run killed before this file was updated simply asks the loop again, which
answers "finished" at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from brats_swap.atomic import atomic_write_json
from brats_swap.errors import DataError
from brats_swap.run.folder import RunFolder


@dataclass
class FoldState:
    fold: int
    trained: bool = False
    evaluated: bool = False
    epochs_completed: int = 0
    best_epoch: int | None = None
    best_val_dice: float | None = None
    stopped_early: bool = False
    train_seconds: float = 0.0  # the fold's training time: its epochs' times (training + validation)
    epoch_seconds: list[float] = field(default_factory=list)  # every epoch of the fold, in order
    peak_memory_bytes: int = 0
    invocations: int = 0  # how many cv invocations trained this fold (1 = never interrupted)
    evaluated_at: str | None = None
    history: list[dict] = field(default_factory=list)  # the loop's per-epoch records (loss, val Dice, times)

    @property
    def done(self) -> bool:
        return self.trained and self.evaluated

    def record_training(self, result, epochs_this_call: int) -> None:
        """Take over what `train_fold` reported (a TrainResult)."""
        self.trained = bool(result.finished)
        self.epochs_completed = int(result.epochs_completed)
        self.best_epoch = result.best_epoch
        self.best_val_dice = result.best_val_dice
        self.stopped_early = bool(result.stopped_early)
        self.peak_memory_bytes = max(self.peak_memory_bytes, int(result.peak_memory_bytes or 0))
        history = list(getattr(result, "history", None) or [])
        if history:
            # The loop's history covers every epoch of the fold, also those of a call killed before this
            # record was written, so times come from it rather than from summing calls.
            self.history = history
            self.epoch_seconds = [float(record.get("epoch_s", 0.0)) for record in history]
            self.train_seconds = sum(self.epoch_seconds)
        elif epochs_this_call:
            self.epoch_seconds = list(self.epoch_seconds) + [float(s) for s in result.epoch_seconds]
            self.train_seconds += float(result.train_seconds)
        if epochs_this_call:
            self.invocations += 1

    def write(self, run_dir: RunFolder | Path) -> None:
        atomic_write_json(RunFolder.of(run_dir).fold(self.fold).state, asdict(self))


def read_fold_state(run_dir: RunFolder | Path, fold: int) -> FoldState:
    path = RunFolder.of(run_dir).fold(fold).state
    if not path.exists():
        return FoldState(fold=fold)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        # Written atomically, so this only happens after a hand edit.
        raise DataError(f"{path}: unreadable fold state ({exc.__class__.__name__}); delete it and re-run, "
                        "training resumes from the checkpoints") from exc
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a JSON object; delete it and re-run")
    known = {f.name for f in fields(FoldState)}
    return FoldState(**{k: v for k, v in raw.items() if k in known})
