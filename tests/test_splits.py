from __future__ import annotations

import json

import pytest

from brats_swap.errors import ConfigError, DataError
from brats_swap.splits import fold_cases, load_or_create_splits, make_splits, subject_of

CASES = [f"BraTS2021_{i:05d}" for i in range(10)]


def test_splits_are_deterministic_and_partition_the_cases():
    a = make_splits(CASES, 5, seed=3)
    assert a == make_splits(CASES, 5, seed=3)
    assert a != make_splits(CASES, 5, seed=4)
    vals = [c for entry in a["folds"] for c in entry["val"]]
    assert sorted(vals) == sorted(CASES)
    for entry in a["folds"]:
        assert set(entry["train"]).isdisjoint(entry["val"])
        assert len(entry["train"]) + len(entry["val"]) == len(CASES)


def test_timepoints_of_one_subject_stay_together():
    cases = [f"BraTS-GLI-{s:05d}-{t:03d}" for s in range(6) for t in range(2)]
    assert subject_of(cases[1]) == "BraTS-GLI-00000"
    splits = make_splits(cases, 3, seed=0)
    for entry in splits["folds"]:
        subjects_val = {subject_of(c) for c in entry["val"]}
        assert subjects_val.isdisjoint({subject_of(c) for c in entry["train"]})


def test_too_many_folds_is_a_config_error():
    with pytest.raises(ConfigError, match="cv.folds"):
        make_splits(CASES[:3], 5, seed=0)


def test_hand_edits_are_respected_and_checked(tmp_path):
    splits = load_or_create_splits(tmp_path, CASES, 5, seed=0)
    path = tmp_path / "splits.json"
    splits["folds"][0] = {"train": CASES[2:], "val": CASES[:2]}
    path.write_text(json.dumps(splits))
    again = load_or_create_splits(tmp_path, CASES, 5, seed=99)
    assert fold_cases(again, 0) == (CASES[2:], CASES[:2])
    splits["folds"][1]["val"] = ["ghost"]
    path.write_text(json.dumps(splits))
    with pytest.raises(DataError, match="ghost"):
        load_or_create_splits(tmp_path, CASES, 5, seed=0)
