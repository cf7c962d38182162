"""Postprocessing tuned on a finished cross-validation: the run folder's `postprocessing.json`.

Once every fold of the run is trained and evaluated, the out-of-fold predictions (`fold_<k>/predictions/
<case>.nii.gz` of each fold's validation cases, saved by the evaluation when `evaluate.save_predictions`
is on) are scored against the dataset's reference segmentations to choose the postprocessing
(`brats_swap.evaluate.postprocessing_rules.tune_postprocessing`: per evaluation group a minimum component size,
and the small enhancing -> necrosis relabelling, each kept only when it clearly raises the mean official
lesion-wise Dice: at least 10 out-of-fold cases, a relative gain of at least 1%, and improvement on a
majority of the cases the rule changes and on at least 3 of them; see `KeepRule`). With fewer cases the plan
is the identity and says why, which `cv_summary.md` shows. The plan
is saved atomically with a digest of the files it was tuned on; a later `cv` invocation tunes again only
when that digest changes (a fold re-evaluated, e.g. with `evaluate --tta`, or a reference replaced), so
re-running a finished cross-validation rewrites nothing. `predict` applies the plan.

When the plan cannot be tuned (predictions not saved, no reference segmentation, cases of several
challenges) the cross-validation is still complete: the reason is said once, no plan is written, and
cv_summary.md gives that reason (or, before every fold is done, how many are).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from brats_swap.config import Config
from brats_swap.cv.fold_progress import fold_standing
from brats_swap.data.challenges import evaluation_groups
from brats_swap.data.discovery import discover_cases
from brats_swap.errors import DataError
from brats_swap.evaluate.postprocessing_rules import (
    KEEP_RULE,
    MIN_SIZE_GRID,
    PostprocessingPlan,
    load_plan,
    relabel_labels,
    save_plan,
    tune_postprocessing,
)
from brats_swap.run.folder import RunFolder
from brats_swap.splits import fold_cases


class _NotTunable(Exception):
    """Why this run's postprocessing cannot be tuned (said to the user, not an error of the cv)."""


def out_of_fold_pairs(config: Config, run: RunFolder, splits: dict) -> tuple[list[tuple[Path, Path]], str]:
    """(prediction, reference) paths of every validation case of every fold, and their challenge key;
    `_NotTunable` when a prediction or reference is missing or the cases mix challenges."""
    validation = [(k, case) for k in range(len(splits["folds"])) for case in fold_cases(splits, k)[1]]
    missing = [run.fold(k).prediction(case) for k, case in validation if not run.fold(k).prediction(case).is_file()]
    if missing:
        raise _NotTunable(f"{missing[0]} is missing (are predictions saved? evaluate.save_predictions)")
    try:
        cases = {case.case_id: case for case in discover_cases(config.data.root, config.data.edition,
                                                               config.data.modalities, config.data.challenge)}
    except DataError as exc:
        raise _NotTunable(str(exc)) from None
    unlabelled = [case for _, case in validation if case not in cases or cases[case].seg is None]
    if unlabelled:
        raise _NotTunable(f"{config.data.root}: case {unlabelled[0]} has no segmentation file there")
    relabelled = [case for _, case in validation if cases[case].relabelled]
    if relabelled:  # the tuning reads reference files as they are; these hold their dataset.json's values
        raise _NotTunable(f"case {relabelled[0]}: its labels follow its dataset.json's numbering, not the table's")
    challenges = sorted({cases[case].edition for _, case in validation})
    if len(challenges) != 1:
        raise _NotTunable(f"the validation cases belong to several challenges ({', '.join(challenges)})")
    return [(run.fold(k).prediction(case), cases[case].seg) for k, case in validation], challenges[0]


def tuning_digest(pairs: list[tuple[Path, Path]], groups: dict, relabel: tuple[int, int] | None) -> str:
    """sha256 over the tuning's settings and the bytes of every prediction and reference file."""
    settings = {"groups": groups, "relabel": relabel, "grid": MIN_SIZE_GRID, "keep": asdict(KEEP_RULE)}
    digest = hashlib.sha256(json.dumps(settings).encode())
    for prediction, reference in pairs:
        for path in (prediction, reference):
            digest.update(path.name.encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _saved_plan(run: RunFolder, say: Callable[[str], None]) -> PostprocessingPlan | None:
    if not run.postprocessing.is_file():
        return None
    try:
        return load_plan(run.postprocessing)
    except DataError as exc:
        say(f"{exc}; tuning it again")
        return None


def tune_after_cv(config: Config, run_dir: RunFolder | Path, splits: dict,
                  say: Callable[[str], None] | None = None) -> tuple[PostprocessingPlan | None, str | None]:
    """Tune and save `postprocessing.json` when every fold of the run is done and the out-of-fold
    predictions changed since the saved plan (see the module docstring). Returns (the run's plan, None), or
    (None, why it was not tuned) while folds are not done or when it cannot be tuned; cv_summary.md prints the
    reason. `say` gets the progress and skip lines."""
    run = RunFolder.of(run_dir)
    say = say or (lambda text: None)
    n_folds = len(splits["folds"])
    done = sum(fold_standing(run, k).state.done for k in range(n_folds))
    if done < n_folds:
        return None, (f"it is tuned on the out-of-fold predictions once every fold is trained and evaluated, "
                      f"and {done} of the run's {n_folds} folds are")
    try:
        pairs, challenge = out_of_fold_pairs(config, run, splits)
    except _NotTunable as reason:
        say(f"[{config.name}] postprocessing not tuned: {reason}")
        return None, str(reason)
    groups, relabel = evaluation_groups(challenge), relabel_labels(challenge)
    digest = tuning_digest(pairs, groups, relabel)
    saved = _saved_plan(run, say)
    if saved is not None and saved.tuned_on == digest:
        return saved, None
    say(f"[{config.name}] tuning the postprocessing on {len(pairs)} out-of-fold predictions")
    plan = tune_postprocessing(pairs, groups, relabel=relabel, report=lambda line: say(f"[{config.name}]   {line}"))
    plan = replace(plan, tuned_on=digest)
    save_plan(plan, run.postprocessing)
    say(f"[{config.name}] postprocessing: {plan.describe()} -> {run.postprocessing}")
    return plan, None


__all__ = ["out_of_fold_pairs", "tune_after_cv", "tuning_digest"]
