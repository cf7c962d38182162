"""Cross-validation as a resumable, cron-safe job: `brats-swap cv` (see runner.py for the contract)."""

from brats_swap.cv.lock import LOCK_FILE, StopControl, run_lock
from brats_swap.cv.runner import CV_LOG, CVOutcome, FoldRunner, resolve_folds, run_cv
from brats_swap.cv.state import STATE_FILE, FoldState, read_fold_state
from brats_swap.cv.summary import BOXPLOT_PNG, SUMMARY_JSON, SUMMARY_MD, write_cv_summary

__all__ = [
    "BOXPLOT_PNG", "CV_LOG", "CVOutcome", "FoldRunner", "FoldState", "LOCK_FILE", "STATE_FILE", "SUMMARY_JSON",
    "SUMMARY_MD", "StopControl", "read_fold_state", "resolve_folds", "run_cv", "run_lock", "write_cv_summary",
]
