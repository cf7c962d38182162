"""`brats-swap cv status`: each fold's state, read from the run folder alone (no scheduler is asked).

A fold is *done* (trained and evaluated), *running* (a process holds its lock: which pid, host and SLURM
job), *stopped* (a checkpoint, nobody working on it: the next `cv` or requeued task continues), *trained*
(waiting for its evaluation), *failed* (its last training call ended with an error: the error's line, from
`fold_<k>/failed.txt`) or *not started*. Where there is a checkpoint: its epoch and step and when it
was written. The stage is `fold_standing`'s (cv/fold_progress.py), the rule cv_summary.* follows too: a fold
trained by `brats-swap train` has no cv state, its checkpoint says whether it finished, and its metrics
(`brats-swap evaluate`) whether it was evaluated.

The folds are those of the run's splits.json; before the first fold started (right after `cv --submit
slurm`, which records config.yaml only) they are the `cv.folds` of the run's config, none started.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from brats_swap.config import load_config
from brats_swap.cv.fold_progress import DONE, fold_standing
from brats_swap.cv.lock import describe_holder, fold_holder
from brats_swap.errors import DataError
from brats_swap.run.folder import RunFolder
from brats_swap.splits import read_splits


@dataclass
class FoldStatus:
    fold: int
    state: str  # done | running | failed: <error line> | stopped | trained | not started
    holder: str = ""  # " (pid P on HOST, SLURM job J)" while running
    epoch: int | None = None  # epochs completed at the last checkpoint
    step_in_epoch: int | None = None  # > 0: the checkpoint is mid-epoch
    checkpoint_at: str | None = None  # UTC time the last checkpoint was written

    def line(self) -> str:
        text = f"fold {self.fold}: {self.state}{self.holder}"
        if self.epoch is not None:
            text += f", epoch {self.epoch} step {self.step_in_epoch}" if self.step_in_epoch else \
                f", {self.epoch} epoch(s) done"
        if self.checkpoint_at is not None:
            text += f", last checkpoint {self.checkpoint_at}"
        return text


def fold_status(run: RunFolder, fold: int) -> FoldStatus:
    standing = fold_standing(run, fold, read_checkpoint=True)
    holder = fold_holder(run, fold)
    status = FoldStatus(fold=fold, state=standing.label)
    if standing.checkpoint is not None and standing.checkpoint_path is not None:
        checkpoint = standing.checkpoint
        status.epoch, status.step_in_epoch = int(checkpoint["epoch"]), int(checkpoint.get("step_in_epoch", 0))
        written = datetime.datetime.fromtimestamp(standing.checkpoint_path.stat().st_mtime, datetime.timezone.utc)
        status.checkpoint_at = written.strftime("%Y-%m-%d %H:%M:%S UTC")
    if standing.stage != DONE and holder is not None:
        status.state, status.holder = "running", describe_holder(holder)
    return status


def run_status(run_dir: RunFolder | Path) -> list[FoldStatus]:
    """Every fold of the run (module docstring), in order."""
    run = RunFolder.of(run_dir)
    if run.splits.exists():
        n_folds = len(read_splits(run.splits)["folds"])
    elif run.config.is_file():
        n_folds = load_config(run.config).cv.folds
    else:
        raise DataError(f"{run.splits}: not found; is {run.root} a cv run folder? (`brats-swap cv` makes it)")
    return [fold_status(run, k) for k in range(n_folds)]


__all__ = ["FoldStatus", "fold_status", "run_status"]
