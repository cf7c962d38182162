"""`brats-swap cv` under torchrun: every fold trains data-parallel on all ranks; rank 0 runs the cv runner.

`run_cv` (cv/dispatch.py) comes here when torchrun started the process. Rank 0 does everything the
sequential runner does (the run lock, preparing the cases the cache lacks while the other ranks wait on the
control channel, splits.json, deciding which folds to train or resume,
`--max-hours` and SIGTERM, evaluation, fold_<k>/state.json, the summary, cv.log). The other ranks only
train: each time rank 0's runner is about to train a fold, it tells them which one (and whether it resumes)
over a control channel, and all ranks enter `train_fold` together, where DDP and the loop's own agreement
(resume state, stop decisions and metrics all come from rank 0 or are reduced) keep them in step. When rank 0
is done, or fails, it tells them to leave.

The control channel is a gloo process group with a long timeout: while rank 0 evaluates a fold (minutes to
an hour on a large validation set) the other ranks wait on it, and that wait must not trip the NCCL
group's watchdog, which is meant to catch real hangs in training.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from brats_swap import stop_signals
from brats_swap.config import Config
from brats_swap.cv.runner import CVOutcome, run_sequential
from brats_swap.distributed import init_distributed
from brats_swap.train.loop import train_fold

CONTROL_TIMEOUT = datetime.timedelta(days=7)


def run_distributed(config: Config, run_dir: Path, folds: Any = "all", max_hours: float | None = None, *,
                    console=None, clock: Callable[[], float] = time.monotonic) -> CVOutcome | None:
    """The cv run on every rank of a torchrun job; returns rank 0's outcome, None on the other ranks."""
    ctx = init_distributed(config.train.device)
    if not ctx.is_distributed:
        return run_sequential(config, run_dir, folds, max_hours, console=console, clock=clock)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # collective: every rank creates it
    if not ctx.is_main:
        _follow(config, Path(run_dir), control)
        return None

    def train_on_every_rank(config: Config, run_dir: Path, fold: int, *, resume: bool, stop_requested):
        _send(control, ("train", fold, resume))
        return train_fold(config, run_dir, fold, resume=resume, stop_requested=stop_requested)

    try:
        return run_sequential(config, run_dir, folds, max_hours, console=console, clock=clock,
                              train=train_on_every_rank)
    finally:
        _send(control, ("done",))  # also after an error (locked run, bad data), so the others exit too


def _follow(config: Config, run_dir: Path, control) -> None:
    """Ranks > 0: train the folds rank 0 names, until it says done.

    SIGTERM and SIGUSR1 (which `cv --nproc` forwards to every worker) are left to rank 0 between folds; a
    rank that died on one would leave the others in a failed collective. While a fold trains, the loop's own
    handlers take them on every rank, and the ranks stop together at the next step.
    """
    stop_signals.ignore(stop_signals.SCHEDULER_SIGNALS)
    while True:
        command = _receive(control)
        if command[0] == "done":
            return
        _, fold, resume = command
        # Stop decisions at epoch boundaries are rank 0's (the loop broadcasts them); ours is never asked.
        train_fold(config, run_dir, fold, resume=resume, stop_requested=_never)


def _never() -> bool:
    return False


def _send(group, message: tuple) -> None:
    dist.broadcast_object_list([message], src=0, group=group)


def _receive(group) -> tuple:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


__all__ = ["CONTROL_TIMEOUT", "run_distributed"]
