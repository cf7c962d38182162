"""`brats-swap compare --patch`: the paper's experiment, whole volumes versus patches, on the same folds.

Two cross-validation runs share one `splits.json`:

- `run_dir/full/`  — whole volumes (`train.mode=full`) with the configured memory policy (swap,
  recompute, hybrid or auto): the method of the paper;
- `run_dir/patch/` — random patches of `train.patch` (`train.mode=patch`), sliding-window inference over
  the whole volume at evaluation, no memory engine (`memory.mode=none`): the baseline as the paper ran it.

Folds are advanced alternately (full fold 0, patch fold 0, full fold 1, ...) so that a run stopped by
`--max-hours` already holds comparable pairs. Each arm is an ordinary cv run folder (its own lock,
`state.json`s, `cv.log`, `cv_summary.*`), so `brats-swap cv run --run run_dir/full` works on it too.

Outputs in `run_dir/` (cv/comparison.py, cv/compare_figures.py): `compare.json`, `compare.md`, and
`figures/compare_dice_boxplot.png` (paired box plots per region, the paper's Fig. 5),
`figures/compare_overlays.png` (ground truth vs both predictions on the axial slice with most tumour, for
the cases whose Dice differs most: Fig. 6), `figures/training_curves.png` (loss and validation Dice per
epoch, both arms).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.atomic import atomic_write_json
from brats_swap.config import Config
from brats_swap.config.loader import validate_config
from brats_swap.cv.comparison import write_comparison
from brats_swap.cv.invocation import cv_invocation, logged_invocation
from brats_swap.cv.lock import run_lock
from brats_swap.cv.runner import CVOutcome, FoldRunner
from brats_swap.cv.stop_control import StopControl
from brats_swap.errors import DataError
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection, resolve_folds
from brats_swap.run.folder import COMPARE_ARMS, RunFolder
from brats_swap.splits import load_run_splits, read_splits
from brats_swap.stop_reasons import StopReason
from brats_swap.train.data import prepare_run_data


@dataclass
class CompareOutcome:
    run_dir: Path
    folds: list[int]
    arms: dict[str, CVOutcome] = field(default_factory=dict)
    run_folds: int = 0  # the run's folds (splits.json); `folds` may be a selection
    stop_reason: StopReason | None = None
    seconds: float = 0.0
    comparison: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(outcome.complete for outcome in self.arms.values()) and len(self.arms) == len(COMPARE_ARMS)

    def describe(self) -> str:
        parts = [f"{arm}: {outcome.describe()}" for arm, outcome in self.arms.items()]
        return " | ".join(parts) if parts else "did not start"


def arm_configs(config: Config) -> dict[str, Config]:
    """The two arms' configs: identical except for the training mode (and no memory engine for patches)."""
    full = copy.deepcopy(config)
    full.train.mode = "full"
    full.name = f"{config.name}-full"
    patch = copy.deepcopy(config)
    patch.train.mode = "patch"
    patch.memory = dataclasses.replace(copy.deepcopy(config.memory), mode="none")
    patch.name = f"{config.name}-patch"
    for arm_config in (full, patch):
        validate_config(arm_config)  # e.g. a patch larger than the cube is reported with its key
    return {"full": full, "patch": patch}


def share_splits(run: RunFolder, arm: RunFolder) -> None:
    """Copy the comparison's splits.json into an arm once; afterwards both must agree."""
    splits = read_splits(run.splits)
    if not arm.splits.exists():
        atomic_write_json(arm.splits, splits)
        return
    if read_splits(arm.splits)["folds"] != splits["folds"]:
        raise DataError(f"{arm.splits}: differs from {run.splits}; both arms must use the same folds "
                        f"(copy {run.splits} over it, or start a new comparison folder)")


def run_compare(config: Config, run_dir: Path, folds: FoldSelection = ALL_FOLDS,
                max_hours: float | None = None, *, console=None,
                clock: Callable[[], float] = time.monotonic) -> CompareOutcome:
    """Train and evaluate folds in both arms, then compare: `folds` is a selection as `run_cv` reads it
    ("all", a fold number, a list of them), of the folds in the run's splits.json.

    Resumable and locked like `run_cv` (the same `cv_invocation`): the comparison folder and each arm
    folder are locked; cv.log lines go to the comparison folder and to each arm. Cases of `data.root` the
    cache lacks are prepared first.
    """
    run = RunFolder.of(run_dir)
    configs = arm_configs(config)
    outcome = CompareOutcome(run_dir=run.root, folds=[])
    with cv_invocation(run, config, max_hours, outcome, lambda: "compare " + outcome.describe(), clock=clock) as stop:
        prepare_run_data(config.data, progress=console is not None)  # once, for both arms (they share the cache)
        outcome.folds, outcome.run_folds = _compared_folds(config, run, folds)
        arms = {arm: run.arm(arm) for arm in COMPARE_ARMS}
        with run_lock(arms["full"]), run_lock(arms["patch"]):
            for arm in COMPARE_ARMS:
                share_splits(run, arms[arm])
            _advance_arms(configs, arms, outcome, stop, console)
        outcome.stop_reason = stop.reason
        outcome.comparison = write_comparison(config, run, outcome.folds)
    return outcome


def _compared_folds(config: Config, run: RunFolder, folds: FoldSelection) -> tuple[list[int], int]:
    """The selected folds of the run's splits.json (made here once), and how many it has."""
    n_folds = len(load_run_splits(config, run)["folds"])
    return resolve_folds(folds, n_folds, option="--folds"), n_folds


def _advance_arms(configs: dict[str, Config], arms: dict[str, RunFolder], outcome: CompareOutcome,
                  stop: StopControl, console) -> None:
    """Advance both arms fold by fold, alternating; each arm's cv.log gets a line for this call."""
    for arm in COMPARE_ARMS:
        outcome.arms[arm] = CVOutcome(run_dir=arms[arm].root, folds=list(outcome.folds), run_folds=outcome.run_folds)
    with contextlib.ExitStack() as arm_logs:
        for arm in COMPARE_ARMS:
            arm_outcome = outcome.arms[arm]
            arm_logs.enter_context(logged_invocation(arms[arm], stop,
                                                     lambda arm_outcome=arm_outcome: f"(compare) {arm_outcome.describe()}"))
        runners = {arm: FoldRunner(configs[arm], arms[arm], stop, console=console) for arm in COMPARE_ARMS}
        for k in outcome.folds:
            if not all(runners[arm].advance(k, outcome.arms[arm]) for arm in COMPARE_ARMS):
                break
        for arm in COMPARE_ARMS:
            runners[arm].finish(outcome.arms[arm])
            outcome.arms[arm].seconds = stop.elapsed_seconds  # the whole compare call: the arms alternate


__all__ = ["CompareOutcome", "arm_configs", "run_compare", "share_splits"]
