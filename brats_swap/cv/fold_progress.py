"""Per-fold progress of a cross-validation run: `fold_<k>/state.json`, written atomically, and the one rule
for where a fold stands (`fold_standing`), which `cv status`, `cv_summary.*`, the runners and `export` share.

A fold is *done* when it is trained (the training loop said `finished`) and evaluated (its metrics are
written from its newest training state: a fold trained further after its evaluation is trained, not evaluated,
until it is evaluated again; `run/evaluation_record.py`). The file is a record, not the source of truth for resuming: the training loop resumes from
`checkpoint_latest.pt`, so a run killed before this file was updated simply asks the loop again, which
answers "finished" at once. A fold trained by `brats-swap train` and scored by `brats-swap evaluate` has no
state.json: its checkpoint says how far it trained and whether it finished, and its `metrics.csv` that it was
evaluated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from brats_swap.atomic import atomic_write_json
from brats_swap.errors import CheckpointError, DataError
from brats_swap.run.evaluation_record import trained_since_evaluation
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


# A fold's stage, as `cv status` prints it and cv_summary.* records it ("running" is not a stage: `cv status`
# adds it when a process holds the fold's lock).
DONE, TRAINED, STOPPED, NOT_STARTED, FAILED = "done", "trained, not evaluated", "stopped", "not started", "failed"


@dataclass
class FoldStanding:
    """Where one fold stands (`fold_standing`): its progress, its stage and, when read, its newest checkpoint."""

    state: FoldState
    stage: str  # DONE | TRAINED | STOPPED | NOT_STARTED | FAILED
    failure: str = ""  # FAILED: the error line of the fold's last training call (fold_<k>/failed.txt)
    trained_since_evaluation: bool = False  # TRAINED: its metrics describe an older training state
    checkpoint: dict | None = None  # the newest good training state, when it was read
    checkpoint_path: Path | None = None

    @property
    def label(self) -> str:
        if self.stage == FAILED:
            return f"{FAILED}: {self.failure}"
        if self.stage == TRAINED and self.trained_since_evaluation:
            return f"{TRAINED} (trained further since its last evaluation)"
        return self.stage


def _from_checkpoint(state: FoldState, checkpoint: dict) -> None:
    """Fill what state.json would say from the training state the loop saved (a fold `train` trained)."""
    history = list(checkpoint.get("history") or [])
    state.trained = bool(checkpoint.get("finished", False))
    state.epochs_completed = int(checkpoint.get("epoch", 0))
    state.best_epoch = checkpoint.get("best_epoch")
    state.best_val_dice = checkpoint.get("best_val_dice")
    state.stopped_early = bool(checkpoint.get("stopped_early", False))
    state.peak_memory_bytes = max(state.peak_memory_bytes, int(checkpoint.get("peak_memory_bytes") or 0))
    if history:
        state.history = history
        state.epoch_seconds = [float(record.get("epoch_s", 0.0)) for record in history]
        state.train_seconds = sum(state.epoch_seconds)


def fold_standing(run_dir: RunFolder | Path, fold: int, *, read_checkpoint: bool = False) -> FoldStanding:
    """Where fold `fold` stands, whoever trained and evaluated it (`cv`, or `train` then `evaluate`).

    state.json is the record where `cv` wrote one that says the fold is trained. Otherwise the newest
    checkpoint says how far training went and whether it finished (a `train` fold, or a cv fold whose record
    was not written before a kill), and the fold's metrics.csv (`brats-swap evaluate --run R --fold K`) that a
    finished fold was evaluated, unless it trained further since (`trained_since_evaluation`). `read_checkpoint` reads the checkpoint also where state.json suffices
    (`cv status` prints its epoch and time); an unreadable checkpoint counts as none.
    """
    run = RunFolder.of(run_dir)
    folder = run.fold(fold)
    state = read_fold_state(run, fold)
    # Metrics written from an older training state than the fold's newest: it trained further (or was replaced)
    # since, so state.json's record of it is stale too and the checkpoint says where it stands.
    stale = folder.metrics_csv.is_file() and trained_since_evaluation(folder)
    checkpoint = checkpoint_path = None
    if read_checkpoint or not state.trained or stale:
        # Imported here: reading a checkpoint needs torch, and the CLI resolves a run's config (which asks where
        # its folds stand) before the training stack loads, so that a config error costs no torch import.
        from brats_swap.run.checkpoint import load_latest

        try:
            loaded = load_latest(folder)
        except CheckpointError:
            loaded = None
        if loaded is not None:
            checkpoint, checkpoint_path = loaded
            if not state.trained or stale:
                _from_checkpoint(state, checkpoint)
                state.evaluated = state.trained and folder.metrics_csv.is_file()
    if stale:
        state.evaluated = False
    standing = FoldStanding(state=state, stage=NOT_STARTED, checkpoint=checkpoint, checkpoint_path=checkpoint_path,
                            trained_since_evaluation=stale)
    if state.done:
        standing.stage = DONE
    elif state.trained:
        standing.stage = TRAINED
    elif folder.failure.is_file():
        standing.stage = FAILED
        standing.failure = folder.failure.read_text(encoding="utf-8", errors="replace").strip()
    elif checkpoint is not None or state.epochs_completed:
        standing.stage = STOPPED
    return standing
