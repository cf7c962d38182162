"""Postprocessing tuned on a finished cross-validation: postprocessing.json from the out-of-fold
predictions, reported in cv_summary.md next to the legacy and official metrics, tuned again only when the
predictions change, and applied by `predict`."""

from __future__ import annotations

import json
from dataclasses import replace

import nibabel as nib
import numpy as np
import pytest
from tiny_cv import copy_run, tiny_cv_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.cv import out_of_fold_tuning as cv_postprocessing
from brats_swap.cv import run_cv
from brats_swap.cv.summary import postprocessing_markdown_lines
from brats_swap.data.challenges import evaluation_groups
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import save_label_nifti
from brats_swap.evaluate.postprocessing_rules import (
    KeepRule,
    PostprocessingPlan,
    apply,
    load_plan,
    relabel_labels,
    save_plan,
    tune_postprocessing,
)
from brats_swap.evaluate.predicting import predict

LEGACY_GROUPS = {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}


@pytest.fixture(scope="module")
def cv_run(tmp_path_factory):
    return tiny_cv_run(tmp_path_factory)


def strict_json(path):
    """JSON that a strict parser accepts (no NaN / Infinity literals)."""
    def refuse(constant):
        raise AssertionError(f"{path.name} holds the non-JSON constant {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


def out_of_fold_pairs(run, root):
    splits = json.loads((run / "splits.json").read_text())
    references = {case.case_id: case.seg for case in discover_cases(root)}
    return [(run / f"fold_{k}" / "predictions" / f"{case}.nii.gz", references[case])
            for k, fold in enumerate(splits["folds"]) for case in fold["val"]]


def test_cv_tunes_postprocessing_on_the_out_of_fold_predictions_and_reports_before_and_after(cv_run):
    _, run, root = cv_run
    plan = load_plan(run / "postprocessing.json")
    assert plan.groups == LEGACY_GROUPS and plan.n_cases == 4 and plan.tuned_on
    assert (plan.enhancing_label, plan.necrosis_label) == (4, 1)
    # The same tuning on the out-of-fold predictions, done here by hand, chooses the same plan.
    pairs = out_of_fold_pairs(run, root)
    assert all(prediction.is_file() for prediction, _ in pairs)
    by_hand = tune_postprocessing(pairs, evaluation_groups("2021"), relabel=relabel_labels("2021"))
    assert by_hand.to_dict() == {**plan.to_dict(), "tuned_on": ""}

    # Four out-of-fold cases are too few to tell a rule's gain from noise: nothing is tuned, and the summary
    # says why.
    assert plan.describe() == "no postprocessing" and plan.rules == ()
    assert "4 out-of-fold cases are fewer than the 10" in plan.not_tuned
    markdown = (run / "cv_summary.md").read_text()
    assert "## Validation metrics" in markdown and "## Official BraTS metrics (lesion-wise)" in markdown
    assert "## Postprocessing, not tuned on the 4 out-of-fold predictions" in markdown
    assert f"No postprocessing: {plan.not_tuned}" in markdown
    summary = strict_json(run / "cv_summary.json")
    assert summary["postprocessing"]["tuned_on"] == plan.tuned_on
    assert summary["official"]["cases"] == 4 and list(summary["official"]["groups"]) == ["WT", "TC", "ET"]
    assert summary["official"]["summary"]["all_instance_tp_wt"]["n"] == 4
    for k in (0, 1):
        strict_json(run / f"fold_{k}" / "official_summary.json")
        strict_json(run / f"fold_{k}" / "summary.json")


def test_cv_summary_shows_each_rule_with_its_value_changed_cases_and_scores():
    # A tuned plan (the keep rule lowered to one case, the four cases of the tiny cv being too few): one
    # 2021 case with a small false-positive enhancing speck where the reference has no enhancing tumour.
    ref = np.zeros((20, 20, 20), np.uint8)
    ref[4:10, 4:10, 4:10] = 2
    pred = ref.copy()
    pred[15:17, 15:17, 15:17] = 4
    plan = tune_postprocessing([(pred, ref), (ref, ref)], LEGACY_GROUPS, relabel=None,
                               keep=KeepRule(min_cases=1, min_improved_cases=1))
    assert plan.min_component_voxels["WT"] > 8  # WT is tuned first and removes the speck
    lines = postprocessing_markdown_lines({"complete": True,
                                           "postprocessing": {**plan.to_dict(), "description": plan.describe()}})
    markdown = "\n".join(lines)
    assert "## Postprocessing, tuned on the 2 out-of-fold predictions" in markdown and plan.describe() in markdown
    wt = next(record for record in plan.rules if record["group"] == "WT")
    assert (f"| WT components below | WT | {wt['value']} | {wt['candidate']} | 1: #0 | 1 / 0 | {wt['before']:.4f} "
            f"| {wt['after']:.4f} | kept |") in markdown
    assert "| ET components below | ET | 0 | 0 | 0 | 0 / 0 |" in markdown  # nothing left to change
    for group in plan.groups:
        before, after = plan.lesionwise_dice_before[group], plan.lesionwise_dice_after[group]
        assert f"| {group} | {plan.min_component_voxels[group]} | {before:.4f} | {after:.4f} |" in markdown


def test_rerunning_cv_keeps_the_plan_until_the_predictions_change(cv_run, tmp_path, monkeypatch):
    config, run, _ = cv_run
    run = copy_run(run, tmp_path / "run")
    saved = (run / "postprocessing.json").read_bytes()

    def no_tuning(*args, **kwargs):
        raise AssertionError("tuned again although the out-of-fold predictions did not change")

    monkeypatch.setattr(cv_postprocessing, "tune_postprocessing", no_tuning)
    assert run_cv(config, run).complete
    assert (run / "postprocessing.json").read_bytes() == saved

    monkeypatch.undo()
    prediction = next((run / "fold_0" / "predictions").iterdir())
    image = nib.load(prediction)
    save_label_nifti(np.zeros(image.shape, np.uint8), image.affine, prediction, header=image.header)
    assert run_cv(config, run).complete
    retuned = load_plan(run / "postprocessing.json")
    assert retuned.tuned_on != json.loads(saved)["tuned_on"]


def test_predict_applies_the_run_postprocessing_unless_turned_off(cv_run, tmp_path):
    _, run, root = cv_run
    run = copy_run(run, tmp_path / "run")
    case = discover_cases(root)[0]
    raw = predict(run, case.seg.parent, tmp_path / "raw", postprocess=False, progress=False)[0]
    raw_labels = np.asarray(nib.load(raw).dataobj)
    assert raw_labels.any()
    # A plan that removes every whole-tumour component: its effect cannot be missed.
    identity = PostprocessingPlan.identity(LEGACY_GROUPS, relabel_labels("2021"))
    save_plan(replace(identity, min_component_voxels={"WT": 10**9, "TC": 0, "ET": 0}), run / "postprocessing.json")
    processed = predict(run, case.seg.parent, tmp_path / "processed", progress=False)[0]
    processed_labels = np.asarray(nib.load(processed).dataobj)
    assert not processed_labels.any()
    np.testing.assert_array_equal(processed_labels, apply(load_plan(run / "postprocessing.json"), raw_labels))

    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(case.seg.parent),
                                      "--out", str(tmp_path / "cli"), "--no-postprocessing"])
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.asarray(nib.load(tmp_path / "cli" / raw.name).dataobj), raw_labels)


def test_a_plan_for_other_groups_is_a_one_line_error(cv_run, tmp_path):
    _, run, root = cv_run
    run = copy_run(run, tmp_path / "run")
    save_plan(PostprocessingPlan.identity(evaluation_groups("gli"), relabel_labels("gli")), run / "postprocessing.json")
    case = discover_cases(root)[0]
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(case.seg.parent),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "postprocessing.json" in errors[0] and "--no-postprocessing" in errors[0]
    assert "NETC [1]" in errors[0] and "WT [1, 2, 4]" in errors[0] and case.case_id in errors[0]
    assert not (tmp_path / "out").exists()  # refused before any case was segmented


def test_compare_reports_show_the_legacy_and_the_official_metrics(cv_run, tmp_path):
    from brats_swap.cv.comparison import write_comparison

    config, run, _ = cv_run
    comparison = tmp_path / "compare"
    for arm in ("full", "patch"):  # the same finished run as both arms: every difference is 0
        copy_run(run, comparison / arm)
    write_comparison(config, comparison, [0, 1])
    markdown = (comparison / "compare.md").read_text()
    assert "## Validation metrics" in markdown and "## Official BraTS metrics (lesion-wise" in markdown
    assert "| ET | Lesion-wise Dice |" in markdown and "| WT | Lesion F1 |" in markdown
    saved = strict_json(comparison / "compare.json")
    assert list(saved["official"]["groups"]) == ["WT", "TC", "ET"]
    assert saved["official"]["full"] == saved["official"]["patch"]
