"""Cross-validation as a resumable, cron-safe job: `brats-swap cv` (`run_cv`, see runner.py for the contract)
and `brats-swap compare --patch` (`brats_swap.cv.compare.run_compare`)."""

from brats_swap.cv.dispatch import run_cv
from brats_swap.cv.fold_progress import FoldState, read_fold_state
from brats_swap.cv.lock import run_lock
from brats_swap.cv.runner import CVOutcome, FoldRunner, resolve_folds
from brats_swap.cv.stop_control import StopControl
from brats_swap.cv.summary import write_cv_summary

__all__ = [
    "CVOutcome", "FoldRunner", "FoldState", "StopControl", "read_fold_state", "resolve_folds", "run_cv", "run_lock",
    "write_cv_summary",
]
