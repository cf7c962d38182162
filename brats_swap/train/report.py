"""What training reports while it runs: a fold's `train.log` and TensorBoard scalars (the one-screen summary
printed after it is `train.summary`)."""

from __future__ import annotations

import time
from typing import Any

from brats_swap.run.dice import dice_column, regions_of_columns
from brats_swap.run.folder import FoldFolder

# Validation scores Ellis's weighted Dice loss whatever `train.loss` is (it drives the LR plateau and early
# stopping, as in the paper's recipe).
VAL_LOSS = "dice"


def loss_names(train_loss: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """(log name, TensorBoard tag) of the training loss and of the validation loss. One name is one quantity:
    they are `train_loss` / `val_loss` (`train/loss`, `val/loss`) when training uses the validation's loss,
    else each says which loss it is (`train_loss(dice_bce)`, `val_loss(dice)`; `val/dice_loss`)."""
    if train_loss == VAL_LOSS:
        return ("train_loss", "train/loss"), ("val_loss", "val/loss")
    return (f"train_loss({train_loss})", "train/loss"), (f"val_loss({VAL_LOSS})", f"val/{VAL_LOSS}_loss")


class TrainLog:
    """`train.log` (timestamped lines, appended across resumes) and TensorBoard scalars (`tb/`) of one fold.

    Only rank 0 writes; built with `write=False` (the other ranks) every method writes nothing.
    `purge_step` (the first epoch of a resumed run) drops events that a crashed run logged after the
    checkpoint it resumes from.
    """

    def __init__(self, folder: FoldFolder, *, write: bool, purge_step: int | None, train_loss: str = VAL_LOSS) -> None:
        self.names = loss_names(train_loss)
        self._file = None
        self._writer = None
        if write:
            from torch.utils.tensorboard import SummaryWriter

            self._file = open(folder.train_log, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
            self._writer = SummaryWriter(str(folder.tensorboard), purge_step=purge_step)

    def line(self, text: str) -> None:
        """Append one timestamped (UTC) line to train.log, flushed at once (a crash keeps it)."""
        if self._file is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            self._file.write(f"{stamp} {text}\n")
            self._file.flush()

    def epoch(self, record: dict[str, Any], memory_stats: dict[str, float], max_epochs: int) -> str:
        """Log one epoch's record (train.log line and scalars); returns the line."""
        epoch = record["epoch"]
        (train_name, train_tag), (val_name, val_tag) = self.names
        parts = [f"epoch {epoch}/{max_epochs}", f"{train_name} {record['train_loss']:.4f}"]
        self._scalar("train/loss", record["train_loss"], epoch)
        self._scalar("lr", record["lr"], epoch)
        self._scalar("time/step_s", record["step_s"], epoch)
        self._scalar("time/epoch_s", record["epoch_s"], epoch)
        self._scalar("time/data_wait_s", record["data_wait_s"], epoch)  # the epoch's steps waiting for batches
        self._scalar("memory/peak_gib", record["peak_memory_gib"], epoch)
        if "compiled" in record:  # train.compile: whether the steps ran compiled, and this epoch's compiling time
            self._scalar("compile/compiled", float(record["compiled"]), epoch)
            self._scalar("compile/seconds", record["compile_s"], epoch)
        for key, value in memory_stats.items():
            self._scalar(f"memory/{key.removeprefix('memory/')}", value, epoch)
        if "val_loss" in record:
            parts.append(f"{val_name} {record['val_loss']:.4f}")
            self._scalar(val_tag, record["val_loss"], epoch)
            for region in regions_of_columns(record):  # the run's regions, as validation scored them
                key = dice_column(region)
                parts.append(f"{key} {record[key]:.4f}")
                self._scalar(f"val/{key}", record[key], epoch)
        parts += [f"lr {record['lr']:.3g}", f"{record['step_s']:.2f} s/step", f"epoch {record['epoch_s']:.1f} s",
                  f"data wait {record['data_wait_s']:.1f} s ({record['data_wait_share']:.0%})",
                  f"peak {record['peak_memory_gib']:.2f} GiB"]
        if record.get("compiled"):
            parts.append(f"compiled ({record['compile_s']:.1f} s compiling)" if record.get("compile_s") else "compiled")
        if record.get("best"):
            parts.append("best")
        line = "  ".join(parts)
        self.line(line)
        if self._writer is not None:
            self._writer.flush()
        return line

    def _scalar(self, tag: str, value: float, epoch: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar(tag, value, epoch)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()
