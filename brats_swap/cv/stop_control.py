"""`StopControl`: when a cron-driven or scheduled cross-validation stops.

It is the `stop_requested` callback handed to the training loop: it turns true when the next epoch would
end past the `--max-hours` window (the loop then saves its checkpoint at that epoch boundary and returns)
or when SIGTERM/SIGUSR1 arrived between folds; while a fold trains, the loop handles those signals itself
and stops at the next step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from brats_swap import stop_signals
from brats_swap.stop_reasons import StopReason


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
        self.reason: StopReason | None = None
        self._last_boundary: float | None = None
        self._epoch_estimate = 0.0

    def __call__(self) -> bool:
        now = self._clock()
        if self._last_boundary is not None:
            self._epoch_estimate = now - self._last_boundary
        self._last_boundary = now
        if self.reason is None and self.deadline is not None and now + self._epoch_estimate >= self.deadline:
            self.reason = StopReason.MAX_HOURS
        return self.reason is not None

    def time_is_up(self) -> bool:
        if self.reason is None and self.deadline is not None and self._clock() >= self.deadline:
            self.reason = StopReason.MAX_HOURS
        return self.reason is not None

    def fold_started(self) -> None:
        """Training of a fold starts now: its first epoch is measured from here (set-up included, which errs
        on the side of stopping early), not from the previous fold's last epoch and evaluation."""
        self._last_boundary = self._clock()

    def request(self, reason: StopReason | str) -> None:
        if self.reason is None:
            self.reason = StopReason(reason)  # a member, or the string one was written as

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
        def handler(signum, frame):  # noqa: ARG001 - signal handler signature
            reason = StopReason.from_signal(signum)
            if self.reason is None:
                # The message explains why nothing stops at once.
                stop_signals.say(f"{reason}: stopping at the next step (checkpoint written there); the next "
                                 "invocation continues")
            self.request(reason)

        with stop_signals.handled(stop_signals.SCHEDULER_SIGNALS, handler):
            yield self
