"""Cross-validation folds as data: `splits.json` in the run folder.

Made once per run folder (seeded shuffle of the case ids, grouped by subject so that follow-up scans of
one patient never straddle train and validation), then read back on every later command. A user may
edit the file by hand; it is respected as long as it names only known cases.

Only cases with a segmentation enter the folds (`labelled_case_ids`): a case prepared without one (an
nnU-Net `imagesTs/`, a BraTS validation case) is for prediction only.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from brats_swap.atomic import atomic_write_json
from brats_swap.config import Config
from brats_swap.data.cache import list_prepared, load_prepared
from brats_swap.errors import ConfigError, DataError
from brats_swap.run.console import warn
from brats_swap.run.folder import ALL_CASES_FOLD, RunFolder

# BraTS 2023+ ids are BraTS-GLI-<subject>-<timepoint>; older editions have one scan per subject.
_TIMEPOINT = re.compile(r"^(?P<subject>.+)-\d{3}$")


def subject_of(case_id: str) -> str:
    match = _TIMEPOINT.match(case_id)
    return match.group("subject") if match and case_id.startswith("BraTS-") else case_id


def make_splits(case_ids: list[str], folds: int, seed: int) -> dict:
    """k folds by subject: each subject's cases go to exactly one validation fold."""
    subjects = sorted({subject_of(c) for c in case_ids})
    if folds < 2:
        raise ConfigError(f"cv.folds: must be at least 2, got {folds}")
    if folds > len(subjects):
        raise ConfigError(f"cv.folds: {folds} folds but only {len(subjects)} subjects in the dataset")
    random.Random(seed).shuffle(subjects)
    fold_of = {subject: i % folds for i, subject in enumerate(subjects)}
    entries = []
    for k in range(folds):
        val = sorted(c for c in case_ids if fold_of[subject_of(c)] == k)
        train = sorted(c for c in case_ids if fold_of[subject_of(c)] != k)
        entries.append({"train": train, "val": val})
    return {"seed": seed, "folds": entries}


def load_or_create_splits(run: RunFolder | Path, case_ids: list[str], folds: int, seed: int,
                          cache: str | Path | None = None) -> dict:
    """Read the run's `splits.json` if present (checking it), else create and write it atomically.

    `case_ids` are the cases a fold may hold; a case of an existing file outside them that `cache` holds
    without a segmentation is named as such (an older or hand-made splits.json)."""
    path = RunFolder.of(run).splits
    if path.exists():
        splits = read_splits(path)
        known = set(case_ids)
        for k, entry in enumerate(splits["folds"]):
            unknown = sorted((set(entry["train"]) | set(entry["val"])) - known)
            if unknown and cache is not None and unknown[0] in unlabelled_case_ids(cache):
                raise DataError(f"{path}: fold {k} names case {unknown[0]!r}, which has no segmentation (it is for "
                                "prediction only); remove it from the file, or train in a new --run folder")
            if unknown:
                raise DataError(f"{path}: fold {k} names case {unknown[0]!r} that is not in the prepared data")
        _say_cases_in_no_fold(path, splits, case_ids)
        return splits
    splits = make_splits(sorted(case_ids), folds, seed)
    atomic_write_json(path, splits)
    return splits


_SAID_IN_NO_FOLD: set[tuple[str, tuple[str, ...]]] = set()  # said once per process, not once per caller


def _say_cases_in_no_fold(path: Path, splits: dict, case_ids: list[str]) -> None:
    """One warning when labelled cases are in no fold of an existing splits.json: typically cases prepared (or
    fixed) after the folds were made, which the run would otherwise leave out without a word."""
    in_folds = {case for entry in splits["folds"] for case in (*entry["train"], *entry["val"])}
    outside = tuple(sorted(set(case_ids) - in_folds))
    if not outside or (str(path), outside) in _SAID_IN_NO_FOLD:
        return
    _SAID_IN_NO_FOLD.add((str(path), outside))
    shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
    warn(f"{path}: {len(outside)} prepared case(s) with a segmentation are in no fold ({shown}), e.g. fixed or "
         "added after the folds were made, so this run does not use them; to include them, add each to one fold's "
         "\"val\" list and to the other folds' \"train\" lists in that file (folds already trained keep what they "
         "learnt), or train in a new --run folder")


def _prepared(cache: Path) -> list[str]:
    case_ids = list_prepared(cache) if cache.exists() else []
    if not case_ids:
        raise DataError(f"{cache}: no prepared cases (data.cache); prepare data.root into it first "
                        "(`brats-swap data prepare`; `train` and `cv` do it themselves)")
    return case_ids


def _has_label(cache: Path, case_id: str) -> bool:
    return load_prepared(cache, case_id).label is not None


def labelled_case_ids(cache: str | Path) -> list[str]:
    """The cases prepared in `cache` (data.cache) with a segmentation: the ones a run's splits are made of.
    DataError if there are none (the unlabelled ones are for prediction only)."""
    cache = Path(cache)
    prepared = _prepared(cache)
    labelled = [case_id for case_id in prepared if _has_label(cache, case_id)]
    if not labelled:
        raise DataError(f"{cache}: none of the {len(prepared)} prepared case(s) has a segmentation; they are for "
                        "prediction only (`brats-swap predict`), training needs labelled cases")
    return labelled


def unlabelled_case_ids(cache: str | Path) -> list[str]:
    """The cases prepared in `cache` without a segmentation: for prediction only, never in a fold."""
    cache = Path(cache)
    return [case_id for case_id in _prepared(cache) if not _has_label(cache, case_id)]


def load_run_splits(config: Config, run: RunFolder | Path, case_ids: list[str] | None = None) -> dict:
    """The run's splits.json, made once (`config.cv.folds` folds seeded by `config.seed`) from `case_ids`,
    by default the prepared cache's labelled cases (`labelled_case_ids`)."""
    if case_ids is None:
        case_ids = labelled_case_ids(config.data.cache)
    return load_or_create_splits(run, case_ids, config.cv.folds, config.seed, cache=config.data.cache)


def read_splits(path: Path) -> dict:
    try:
        splits = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read splits ({exc.__class__.__name__})") from exc
    folds = splits.get("folds") if isinstance(splits, dict) else None
    if not isinstance(folds, list) or not folds:
        raise DataError(f"{path}: expected {{\"folds\": [{{\"train\": [...], \"val\": [...]}}, ...]}}")
    for k, entry in enumerate(folds):
        if not (isinstance(entry, dict) and isinstance(entry.get("train"), list) and isinstance(entry.get("val"), list)):
            raise DataError(f"{path}: fold {k} must have 'train' and 'val' lists")
        if not entry["train"] or not entry["val"]:
            raise DataError(f"{path}: fold {k} has an empty train or val list")
        overlap = set(entry["train"]) & set(entry["val"])
        if overlap:
            raise DataError(f"{path}: fold {k} has case {sorted(overlap)[0]!r} in both train and val")
    return splits


def fold_cases(splits: dict, fold: int) -> tuple[list[str], list[str]]:
    """(train, val) case ids of `fold`. The all-cases model (`ALL_CASES_FOLD`) trains on every case of the
    splits and, as nnU-Net's fold `all` does, "validates" on the same cases: its val numbers only steer the
    schedule and are no held-out estimate."""
    folds = splits["folds"]
    if fold == ALL_CASES_FOLD:
        every = sorted({case for entry in folds for case in entry["train"] + entry["val"]})
        return every, list(every)
    if not 0 <= fold < len(folds):
        raise ConfigError(f"--fold {fold}: the run has folds 0..{len(folds) - 1}")
    return list(folds[fold]["train"]), list(folds[fold]["val"])
