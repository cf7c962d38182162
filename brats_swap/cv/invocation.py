"""One invocation of a cv command, set up in one place: the lock, the stop control and the cv.log line.

`cv_invocation` is what the sequential runner, the parallel-folds runner and `compare` share, in this
order:

1. `--max-hours` is resolved (the option, else `cv.max_hours`) and checked, before anything is touched;
2. the run folder's `.lock` is shared (cv/lock.py: fold locks are taken by the runner once it knows the
   folds; a process holding the whole run, or the same fold, makes this one fail with `RunLockedError`,
   exit 75, leaving no trace, not even a cv.log line);
3. a `StopControl` starts the `--max-hours` window and turns SIGTERM/SIGUSR1 into a stop for the duration
   of the block (the previous handler is restored afterwards);
4. when the block ends, however it ends, one line is appended to `cv.log` and the outcome's `seconds` is set.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from brats_swap.config import Config
from brats_swap.cv.lock import run_share, shared_files
from brats_swap.cv.stop_control import StopControl
from brats_swap.errors import BratsSwapError, ConfigError, RunLockedError
from brats_swap.run.folder import RunFolder
from brats_swap.timestamps import utc_now


class TimedOutcome(Protocol):
    seconds: float


def resolve_max_hours(config: Config, max_hours: float | None) -> float | None:
    """The `--max-hours` window of an invocation: the option, else the config's `cv.max_hours` (None = none)."""
    max_hours = max_hours if max_hours is not None else config.cv.max_hours
    if max_hours is not None and max_hours <= 0:
        raise ConfigError(f"--max-hours {max_hours}: must be positive")
    return max_hours


def _append_cv_log(run_dir: RunFolder | Path, line: str) -> None:
    # One short O_APPEND write per invocation: a crash can lose the line but never corrupt earlier ones.
    with shared_files(run_dir), open(RunFolder.of(run_dir).cv_log, "a", encoding="utf-8") as handle:
        handle.write(line.rstrip("\n") + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def logged_invocation(run_dir: RunFolder | Path, stop: StopControl, describe: Callable[[], str]) -> Iterator[None]:
    """Append one `cv.log` line when the block ends: how long, how it ended (exit code) and what it did.

    Also when the block fails or is interrupted, so that every invocation leaves the same kind of line;
    `compare` writes one into each arm's folder as well as its own.
    """
    status = "error"
    try:
        yield
        status = "exit 0"
    except RunLockedError:
        status = None  # another process works on it: this call did nothing and leaves no trace
        raise
    except BratsSwapError as exc:
        status = f"exit {exc.exit_code} ({exc.__class__.__name__}: {' '.join(str(exc).split())})"
        raise
    except KeyboardInterrupt:
        status = "exit 130 (interrupted)"
        raise
    finally:
        if status is not None:
            _append_cv_log(run_dir, f"{utc_now()} pid={os.getpid()} {stop.elapsed_seconds:.1f}s {status}: "
                                    f"{describe()}")


@contextlib.contextmanager
def cv_invocation(run_dir: RunFolder | Path, config: Config, max_hours: float | None, outcome: TimedOutcome,
                  describe: Callable[[], str], *, clock: Callable[[], float] = time.monotonic
                  ) -> Iterator[StopControl]:
    """Lock the run, start the stop control and log the invocation (see the module docstring).

    Yields the `StopControl` to hand to the training loop as `stop_requested`; `describe()` gives the
    cv.log line's account of what the block did, `outcome.seconds` receives the invocation's duration.
    """
    max_hours = resolve_max_hours(config, max_hours)
    with run_share(run_dir):
        stop = StopControl(max_hours, clock=clock)
        try:
            with logged_invocation(run_dir, stop, describe), stop.on_signals():
                yield stop
        finally:
            outcome.seconds = stop.elapsed_seconds


__all__ = ["cv_invocation", "logged_invocation", "resolve_max_hours"]
