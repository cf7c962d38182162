"""`StopReason`: why a training call or a cross-validation invocation stopped before it was done.

One enum for what used to be strings compared in several places (the training loop's signal flag,
`StopControl`, the parallel folds' workers, the runner's one-line summary). The values are the strings
those places wrote before (a train.log line, a cv.log line, a test's expectation), so a member compares
equal to its old string, formats as it, and `StopReason(text)` reads one back.
"""

from __future__ import annotations

import enum

from brats_swap import stop_signals


class StopReason(str, enum.Enum):
    SIGINT = "SIGINT"  # Ctrl-C: stop with the state saved and exit 130
    SIGTERM = "SIGTERM"  # a scheduler's warning, a preemption, a plain kill: state saved, exit 0
    SIGUSR1 = "SIGUSR1"  # SLURM's `--signal=B:USR1@N` before the time limit
    MAX_HOURS = "max-hours"  # the `--max-hours` window would close before the next epoch ends
    PARENT_STOPPED = "stopped by the parent"  # a parallel-folds worker: the parent set the shared stop event
    PARENT_EXITED = "parent exited"  # a parallel-folds worker whose parent process is gone
    OTHER_RANK = "a signal on another rank"  # distributed training: another rank got the signal
    UNFINISHED = "interrupted"  # training returned unfinished without naming why

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
    @classmethod
    def from_signal(cls, signum: int) -> StopReason:
        """`signal.SIGTERM` -> `StopReason.SIGTERM` (one of `stop_signals.STOP_SIGNALS`)."""
        return cls(stop_signals.name(signum))

    @property
    def is_interrupt(self) -> bool:
        """Ctrl-C: "stop and tell me" (exit 130), unlike the planned stops (exit 0)."""
        return self is StopReason.SIGINT

    @property
    def prose(self) -> str:
        """How the cv summary line says it."""
        return _PROSE.get(self, "stopped")


_PROSE = {
    StopReason.MAX_HOURS: "the --max-hours window closed at an epoch boundary",
    StopReason.SIGTERM: "SIGTERM received",
    StopReason.SIGUSR1: "SIGUSR1 received",
}


__all__ = ["StopReason"]
