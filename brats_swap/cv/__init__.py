"""Cross-validation as a resumable, cron-safe job: `brats-swap cv` (`run_cv`, see runner.py for the contract)
and `brats-swap compare --patch` (`brats_swap.cv.compare.run_compare`)."""

from typing import Any

__all__ = [
    "CVOutcome", "FoldRunner", "FoldState", "StopControl", "read_fold_state", "resolve_folds", "run_cv", "run_lock",
    "write_cv_summary",
]


def __getattr__(name: str) -> Any:
    """The names above, imported when first asked for (PEP 562): the light modules of this package
    (run_config.py, lock.py) are read by commands that stop at a config error before any training, and
    importing a submodule runs this file first."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from brats_swap.cv.dispatch import run_cv
    from brats_swap.cv.fold_progress import FoldState, read_fold_state
    from brats_swap.cv.lock import run_lock
    from brats_swap.cv.runner import CVOutcome, FoldRunner, resolve_folds
    from brats_swap.cv.stop_control import StopControl
    from brats_swap.cv.summary import write_cv_summary

    exported = {"CVOutcome": CVOutcome, "FoldRunner": FoldRunner, "FoldState": FoldState,
                "StopControl": StopControl, "read_fold_state": read_fold_state, "resolve_folds": resolve_folds,
                "run_cv": run_cv, "run_lock": run_lock, "write_cv_summary": write_cv_summary}
    globals().update(exported)
    return exported[name]
