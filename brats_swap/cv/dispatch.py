"""`run_cv`: the one entry of `brats-swap cv`. It trains and evaluates every fold of a run, resumably, one
cron invocation at a time (the contract of one invocation: cv/runner.py), and picks how the folds are
trained:

- under torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK` set): every fold data-parallel on all ranks, rank 0
  orchestrating (cv/ddp.py);
- `parallel_folds > 1`: that many folds at once in worker processes (cv/parallel.py);
- otherwise: one fold after the other in this process (`runner.run_sequential`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from brats_swap.config import Config
from brats_swap.cv.ddp import run_distributed
from brats_swap.cv.parallel import run_parallel_folds
from brats_swap.cv.runner import CVOutcome, run_sequential
from brats_swap.distributed import launched_by_torchrun
from brats_swap.errors import ConfigError
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection


def run_cv(config: Config, run_dir: Path, folds: FoldSelection = ALL_FOLDS, max_hours: float | None = None, *,
           parallel_folds: int = 1, console=None, clock: Callable[[], float] = time.monotonic) -> CVOutcome | None:
    """Continue the run's cross-validation where the last invocation stopped (see the module docstring).

    `folds`: "all", a fold number or fold numbers. `max_hours`: the window (default `cv.max_hours`).
    `parallel_folds`: folds trained at once, each in a worker process (not under torchrun, where every
    fold already uses all ranks). `console`: a rich console for progress lines (None = quiet). `clock`:
    the window's clock; the parallel runner's workers share `time.monotonic`, so only that one goes there.

    Returns the invocation's outcome (`ParallelCVOutcome` with parallel folds); None on torchrun ranks > 0,
    which only follow rank 0's folds. Raises RunLockedError (exit 75) at once, touching nothing, when
    another process holds the run.
    """
    if launched_by_torchrun():
        if parallel_folds != 1:
            raise ConfigError("--parallel-folds: not under torchrun (there every fold already uses all ranks); "
                              "run it as a plain command")
        return run_distributed(config, run_dir, folds, max_hours, console=console, clock=clock)
    if parallel_folds != 1:
        if clock is not time.monotonic:
            raise ValueError("clock: parallel folds share time.monotonic's deadline with their workers")
        return run_parallel_folds(config, run_dir, folds, max_hours, parallel=parallel_folds, console=console)
    return run_sequential(config, run_dir, folds, max_hours, console=console, clock=clock)


__all__ = ["run_cv"]
