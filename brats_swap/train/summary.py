"""The one-screen summary panel printed after a fold's training (by `brats-swap train` and `make demo`)."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from brats_swap.config import Config
from brats_swap.memory.budget import GIB
from brats_swap.run.dice import dice_column, regions_of_columns
from brats_swap.train.loop import TrainResult
from brats_swap.train.report import loss_names


def summary_panel(result: TrainResult, config: Config) -> Panel:
    """The one-screen summary printed after training: the epochs (first 3 and last 9 of a long run), status, best."""
    table = Table(show_header=True, header_style="bold")
    table.add_column("epoch", justify="right")
    (train_name, _), (val_name, _) = loss_names(config.train.loss)
    table.add_column(train_name.replace("_loss", " loss", 1), justify="right")
    table.add_column(val_name.replace("_loss", " loss", 1), justify="right")
    history = result.history
    regions = regions_of_columns(key for record in history for key in record)
    for region in regions:
        table.add_column(f"Dice {region}", justify="right")
    table.add_column("s/step", justify="right")
    shown = history if len(history) <= 12 else history[:3] + history[-9:]
    for record in shown:
        val = "val_loss" in record
        table.add_row(
            f"{record['epoch']}{' *' if record.get('best') else ''}", f"{record['train_loss']:.4f}",
            f"{record['val_loss']:.4f}" if val else "",
            *[f"{record[dice_column(r)]:.3f}" if val else "" for r in regions],
            f"{record['step_s']:.2f}",
        )
    if result.finished:
        status = "stopped early" if result.stopped_early else "finished"
    else:
        status = "interrupted (resume with --resume)" if result.interrupted else "not finished"
    best = (f"best mean val Dice {result.best_val_dice:.4f} at epoch {result.best_epoch} (*)"
            if result.best_val_dice is not None else "no validation yet")
    lines = (f"fold {result.fold}: {status} after {result.epochs_completed} epoch(s); {best}\n"
             f"time {result.train_seconds:.1f} s this call; peak memory {result.peak_memory_bytes / GIB:.2f} GiB"
             f"{_peak_meaning(result, config)}; checkpoints in {result.fold_dir}")
    return Panel(Group(table, lines), title=f"[bold]{config.name}[/] training summary", expand=False)


def _peak_meaning(result: TrainResult, config: Config) -> str:
    """What the peak measures where it is not what `memory.budget_gib` budgets (the device memory training
    allocates): on a CPU it is the whole process's resident set (`run.device.peak_memory_bytes`)."""
    if not result.device.startswith("cpu"):
        return ""
    budget = config.memory.budget_gib
    over = (f", above memory.budget_gib {budget:g} because that budgets the memory the step allocates, not the "
            "process" if budget is not None and result.peak_memory_bytes > budget * GIB else "")
    return f" (CPU: the process's peak resident memory, Python, libraries and data included{over})"
