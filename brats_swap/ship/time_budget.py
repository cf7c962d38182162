"""A time budget for a whole run of the challenge's image: parsing `--time-budget` and deciding what to drop.

After each case, the time so far plus the remaining cases at the last case's pace is the projection; when it
passes the budget, test-time augmentation is dropped first, then folds (keeping as many as the pace allows),
and each change is said.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from brats_swap.errors import ConfigError

_DURATION = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`8h`, `90m`, `3600`, `1.5h`, `45s`, `1d` -> seconds; ConfigError for anything else."""
    match = _DURATION.match(str(text))
    if match is None or float(match["number"]) <= 0:
        raise ConfigError(f"--time-budget {text!r}: expected a positive duration like 8h, 90m or 3600s")
    return float(match["number"]) * _UNIT_SECONDS[match["unit"].lower()]


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


@dataclass
class TimeBudget:
    """The whole test set's time, and what to drop when the cases done so far project past it."""

    seconds: float
    total: int
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    said_exhausted: bool = False

    def after_case(self, case_seconds: float, tta: bool, folds: int) -> tuple[bool, int, str | None]:
        """(tta, folds, what changed or None) for the cases still to do, after one took `case_seconds`."""
        self.done += 1
        remaining = self.total - self.done
        elapsed = time.monotonic() - self.started
        projected = elapsed + remaining * case_seconds
        if remaining == 0 or projected <= self.seconds:
            return tta, folds, None
        why = (f"time budget {_clock(self.seconds)}: {self.done} of {self.total} cases took {_clock(elapsed)}, the "
               f"{remaining} left at {case_seconds:.1f} s each project to {_clock(projected)}")
        if tta:
            return False, folds, f"{why}; dropping test-time augmentation (8 mirrorings -> 1)"
        if folds > 1:
            per_fold = case_seconds / folds
            allowed = max(self.seconds - elapsed, 0.0) / remaining
            keep = min(folds - 1, max(1, int(allowed // per_fold)))
            return tta, keep, f"{why}; dropping folds ({folds} -> {keep})"
        if not self.said_exhausted:
            self.said_exhausted = True
            return tta, folds, f"{why}; already one fold without test-time augmentation, going on"
        return tta, folds, None
