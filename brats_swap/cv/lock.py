"""What makes a run folder safe under cron: an exclusive lock and a clean way to stop.

`run_lock` takes `fcntl.flock(LOCK_EX | LOCK_NB)` on the run folder's `.lock` before anything in the run is
written, so a second invocation (tonight's cron job while last night's is still running) fails at once
with `RunLockedError` (exit 75, EX_TEMPFAIL) and leaves the run untouched. The kernel drops the lock when
the process dies, even by SIGKILL, so there is never a stale lock to clean up by hand.

`StopControl` is the `stop_requested` callback handed to the training loop: it turns true when the next
epoch would end past the `--max-hours` window (the loop then saves its checkpoint at that epoch boundary
and returns) or when SIGTERM/SIGUSR1 arrived between folds; while a fold trains, the loop handles those
signals itself and stops at the next step.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from brats_swap.errors import RunLockedError
from brats_swap.run.folder import RunFolder

# A scheduler's warnings: SIGTERM (a plain kill, a preemption) and SIGUSR1 (SLURM's `--signal=B:USR1@N`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def run_lock(run_dir: RunFolder | Path) -> Iterator[Path]:
    """Hold the run folder's exclusive lock for the duration of the block (non-blocking)."""
    run = RunFolder.of(run_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    # No O_TRUNC: the file may belong to the process that holds the lock. O_CLOEXEC keeps programs we
    # exec from inheriting (and so prolonging) the lock.
    fd = os.open(run.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunLockedError(
            f"{run.root}: another brats-swap process{holder} is working on this run (lock {run.lock}); "
            "nothing was changed, try again when it has finished"
        ) from None
    try:
        # Only the lock holder writes its pid, so the message above can name it.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield run.lock
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


class StopControl:
    """Decides when a cron-driven run should stop: SIGTERM, or the `--max-hours` window closing.

    Call it (no arguments) at each epoch boundary: it returns True when training should stop there.
    With a window, it also stops when the *next* epoch would not fit, estimating an epoch's length from
    the time between the last two boundaries, so that a nightly window is respected rather than overrun
    by one epoch. Between phases (before a fold starts, before an evaluation) use `time_is_up()`,
    which does not disturb that estimate.
    """

    def __init__(self, max_hours: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.deadline = None if max_hours is None else self.started + max_hours * 3600.0
        self.reason: str | None = None
        self._last_boundary: float | None = None
        self._epoch_estimate = 0.0

    def __call__(self) -> bool:
        now = self._clock()
        if self._last_boundary is not None:
            self._epoch_estimate = now - self._last_boundary
        self._last_boundary = now
        if self.reason is None and self.deadline is not None and now + self._epoch_estimate >= self.deadline:
            self.reason = "max-hours"
        return self.reason is not None

    def time_is_up(self) -> bool:
        if self.reason is None and self.deadline is not None and self._clock() >= self.deadline:
            self.reason = "max-hours"
        return self.reason is not None

    def fold_started(self) -> None:
        """Training of a fold starts now: its first epoch is measured from here (set-up included, which errs
        on the side of stopping early), not from the previous fold's last epoch and evaluation."""
        self._last_boundary = self._clock()

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @property
    def elapsed_seconds(self) -> float:
        return self._clock() - self.started

    @contextlib.contextmanager
    def on_signals(self) -> Iterator[StopControl]:
        """While in the block, SIGTERM and SIGUSR1 set the stop flag instead of killing the process.

        Between folds and during evaluation this handler sees them; while a fold trains, the training loop's
        own handlers do (they stop at the next step with a mid-epoch checkpoint) and the runner takes the
        reason from the loop's result.
        """
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be installed from the main thread
            return
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        def handler(signum, frame):  # noqa: ARG001 - signal handler signature
            name = signal.Signals(signum).name
            if self.reason is None:
                # os.write is safe inside a signal handler; the message explains why nothing stops at once.
                os.write(2, f"{name}: stopping at the next step (checkpoint written there); the next "
                            "invocation continues\n".encode())
            self.request(name)

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)
        try:
            yield self
        finally:
            for sig, handler_before in previous.items():
                signal.signal(sig, handler_before)
