"""One `brats-swap cv` invocation in this process, fold after fold (`run_sequential`), and the pieces the
other ways of running the folds share (`FoldRunner`, `prepared_runner`, `CVOutcome`); `run_cv`
(cv/dispatch.py) picks the way.

Each way, one invocation:

1. shares the run folder's lock, and once the folds are known takes their locks (before writing anything
   of them; a second invocation on the same fold gets exit 75; other folds run at once elsewhere);
2. prepares the cases of `data.root` that `data.cache` lacks or holds stale (once, in this process, before
   any fold or rank starts: `train.data.prepare_run_data`), then reads (or makes, once) `splits.json`;
3. for each selected fold that is not done: resumes its training from `checkpoint_latest.pt` (or starts
   it), then evaluates it on its validation cases; a fold is done when trained and evaluated;
4. stops at an epoch boundary when the `--max-hours` window would be overrun, at the next step when SIGTERM
   or SIGUSR1 arrives (the checkpoint, mid-epoch if need be, is written by the training loop; the next
   invocation carries on);
5. once every fold is done, tunes `postprocessing.json` on the out-of-fold predictions (again only when
   they changed: cv/out_of_fold_tuning.py); rewrites `cv_summary.json`, `cv_summary.md`, `figures/dice_boxplot.png`
   over every fold of the run, also those this call was not asked for (`"complete"` means all of them are done);
6. appends one line to `cv.log` saying what it did, how long it took and how it ended.

Steps 1, 4 (the window and SIGTERM) and 6 are set up once, by `cv_invocation` (cv/invocation.py).

Exit status: 0 whenever the run is consistent, whether complete or stopped by the window/SIGTERM: under
cron a planned stop is success (a non-zero status would send an error mail every night). Whether the run
is complete is in the message, `cv.log` and `cv_summary.json["complete"]`. 75 = locked, try later.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from brats_swap.config import Config
from brats_swap.cv.fold_progress import fold_standing
from brats_swap.cv.invocation import cv_invocation
from brats_swap.cv.lock import fold_locks, shared_files
from brats_swap.cv.out_of_fold_tuning import tune_after_cv
from brats_swap.cv.stop_control import StopControl
from brats_swap.cv.summary import write_cv_summary
from brats_swap.evaluate.scoring import evaluate_fold
from brats_swap.run.fold_selection import ALL_FOLDS, FoldSelection, resolve_folds
from brats_swap.run.folder import RunFolder
from brats_swap.splits import fold_cases, load_run_splits
from brats_swap.stop_reasons import StopReason
from brats_swap.timestamps import utc_now
from brats_swap.train.data import prepare_run_data
from brats_swap.train.loop import train_fold


@dataclass
class CVOutcome:
    run_dir: Path
    folds: list[int]  # the folds this invocation was asked to complete
    done: list[int] = field(default_factory=list)  # trained and evaluated (now or before)
    started: list[int] = field(default_factory=list)  # training began from scratch in this invocation
    resumed: list[int] = field(default_factory=list)  # training continued from checkpoint_latest
    evaluated: list[int] = field(default_factory=list)  # evaluated in this invocation
    epochs_trained: dict[int, int] = field(default_factory=dict)  # fold -> epochs trained now
    stop_reason: StopReason | None = None  # why this invocation stopped before completing
    seconds: float = 0.0
    summary: dict = field(default_factory=dict)
    exit_code: int = 0  # see the module docstring: a planned stop is success
    run_folds: int = 0  # the run's folds (splits.json), when known: `folds` may be a selection of them

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.folds)

    @property
    def stopped(self) -> bool:
        return not self.complete and self.stop_reason is not None

    def describe_or_not_started(self) -> str:
        return self.describe() if self.folds else "did not start"

    def _counted(self) -> str:
        """"2 fold(s)", or for a selection of the run's folds "1 selected fold(s) (0; the run has 2)"."""
        if not self.run_folds or len(self.folds) == self.run_folds:
            return f"{len(self.folds)} fold(s)"
        return f"{len(self.folds)} selected fold(s) ({', '.join(map(str, self.folds))}; the run has {self.run_folds})"

    def describe(self) -> str:
        """One line for cv.log and the terminal."""
        parts = []
        for k in self.folds:
            did = []
            if k in self.started:
                did.append(f"trained {self.epochs_trained.get(k, 0)} epoch(s)")
            elif k in self.resumed:
                did.append(f"resumed, trained {self.epochs_trained.get(k, 0)} epoch(s)")
            if k in self.evaluated:
                did.append("evaluated")
            if did:
                parts.append(f"fold {k}: " + ", ".join(did))
        action = "; ".join(parts) if parts else "nothing to train or evaluate, summary refreshed"
        if self.complete:
            state = f"all {self._counted()} done"
        elif self.stop_reason is None:  # `cv summary`: nothing was asked to train
            state = f"{len(self.done)}/{self._counted()} done"
        else:
            why = self.stop_reason.prose
            state = (f"{len(self.done)}/{self._counted()} done; stopped ({why}) with the checkpoint written, the next "
                     "invocation continues")
        return f"{action}; {state}"


class FoldRunner:
    """Advances the folds of one run folder; the caller holds the lock. Used by `run_cv` and `compare`."""

    def __init__(self, config: Config, run_dir: RunFolder | Path, stop: StopControl, console=None, train=None) -> None:
        self.config = config
        self.train = train  # None = train_fold; cv under torchrun passes one that brings the other ranks along
        self.run = RunFolder.of(run_dir)
        self.run_dir = self.run.root
        self.stop = stop
        self.console = console
        self.splits = load_run_splits(config, self.run_dir)
        self.n_folds = len(self.splits["folds"])

    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    def advance(self, fold: int, outcome: CVOutcome) -> bool:
        """Train (or resume) and evaluate one fold; False when the run must stop here."""
        fold_cases(self.splits, fold)  # validates the fold number against the run's splits
        # The rule `cv status` and the summary follow: a fold `train` finished and `evaluate` scored is done.
        state = fold_standing(self.run_dir, fold).state
        if state.done:
            return True
        if not state.trained:
            if self.stop.time_is_up():
                return False
            checkpoints = self.run.fold(fold)
            resume = checkpoints.latest.exists() or checkpoints.previous.exists()
            self._say(f"[{self.config.name}] fold {fold}: {'resuming' if resume else 'training'}")
            self.stop.fold_started()
            train = self.train or train_fold
            result = train(self.config, self.run_dir, fold, resume=resume, stop_requested=self.stop)
            trained_now = len(result.epoch_seconds)  # the loop reports only this call's epochs there
            if trained_now or not resume:
                (outcome.resumed if resume else outcome.started).append(fold)
                outcome.epochs_trained[fold] = trained_now
            state.record_training(result, trained_now)
            state.write(self.run_dir)
            if not result.finished:
                self.stop.request(getattr(result, "stop_reason", None) or StopReason.UNFINISHED)
                return False
        if self.stop.time_is_up():
            return False
        self._say(f"[{self.config.name}] fold {fold}: evaluating")
        evaluate_fold(self.config, self.run_dir, fold, checkpoint="best")
        state.evaluated = True
        state.evaluated_at = utc_now()
        state.write(self.run_dir)
        outcome.evaluated.append(fold)
        return True

    def finish(self, outcome: CVOutcome) -> None:
        """Close an invocation: why it stopped, which of its folds are done, and the refreshed summary, which
        covers every fold of the run whichever folds this call was asked for (`build_cv_summary`)."""
        outcome.stop_reason = self.stop.reason
        outcome.done = [k for k in outcome.folds if fold_standing(self.run_dir, k).state.done]
        with shared_files(self.run):
            _, not_tuned = tune_after_cv(self.config, self.run, self.splits, say=self._say)  # every fold done
            outcome.summary = write_cv_summary(self.config.name, self.run_dir, self.splits, not_tuned)


def summarise_run(config: Config, run_dir: Path, *, console=None) -> CVOutcome:
    """`cv summary`: train and evaluate nothing; write cv_summary.* (and tune postprocessing.json once every
    fold is done) from the folds as they are, e.g. in the job that follows a SLURM array."""
    outcome = CVOutcome(run_dir=Path(run_dir), folds=[])
    with cv_invocation(run_dir, config, None, outcome, outcome.describe_or_not_started) as stop:
        with shared_files(run_dir):
            runner = FoldRunner(config, run_dir, stop, console=console)
        outcome.folds, outcome.run_folds = list(range(runner.n_folds)), runner.n_folds
        runner.finish(outcome)
    return outcome


def prepared_runner(config: Config, run_dir: Path, stop: StopControl, *, console=None, train=None) -> FoldRunner:
    """The cases of `data.root` the cache lacks prepared and splits.json read (or made), in the run's shared
    critical section: the first of several processes starting on one run does it, the others wait."""
    with shared_files(run_dir):
        prepare_run_data(config.data, progress=console is not None)
        return FoldRunner(config, run_dir, stop, console=console, train=train)


def run_sequential(config: Config, run_dir: Path, folds: FoldSelection = ALL_FOLDS, max_hours: float | None = None,
                   *, console=None, clock: Callable[[], float] = time.monotonic, train=None) -> CVOutcome:
    """The folds in this process, one after the other; `train` replaces `train_fold` (see FoldRunner)."""
    outcome = CVOutcome(run_dir=Path(run_dir), folds=[])
    with cv_invocation(run_dir, config, max_hours, outcome, outcome.describe_or_not_started, clock=clock) as stop:
        runner = prepared_runner(config, run_dir, stop, console=console, train=train)
        outcome.folds, outcome.run_folds = resolve_folds(folds, runner.n_folds), runner.n_folds
        with fold_locks(run_dir, outcome.folds):  # another process on one of them: exit 75, nothing touched
            for k in outcome.folds:
                if not runner.advance(k, outcome):
                    break
            runner.finish(outcome)
    return outcome


__all__ = ["CVOutcome", "FoldRunner", "prepared_runner", "resolve_folds", "run_sequential", "summarise_run"]
