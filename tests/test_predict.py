"""`brats-swap predict` as the leaderboard expects (fold ensemble, mirroring TTA, probabilities, the
challenge's labels on the input's grid) and `evaluate --run --tta`, on a tiny finished 2-fold cv run."""

from __future__ import annotations

import csv
import json
import shutil

import nibabel as nib
import numpy as np
import pytest
from tiny_cv import LEGACY_LABELS, copy_run, tiny_cv_run
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.data.discovery import discover_cases
from brats_swap.evaluate import predicting
from brats_swap.evaluate.official import official_columns
from brats_swap.evaluate.postprocessing_rules import apply, load_plan
from brats_swap.evaluate.scoring import evaluate_predictions
from brats_swap.model.targets import labels_from_probs, output_names
from brats_swap.run.trained import load_run_config


@pytest.fixture(scope="module")
def cv_run(tmp_path_factory):
    return tiny_cv_run(tmp_path_factory)


@pytest.fixture(scope="module")
def two_cases(cv_run, tmp_path_factory):
    """A dataset folder with 2 of the run's 4 cases: enough to see every case of a folder get its own files,
    at half the cost of the TTA and fold-ensemble predictions below."""
    root = tmp_path_factory.mktemp("two-cases")
    for case in discover_cases(cv_run[2])[:2]:
        shutil.copytree(case.seg.parent, root / case.seg.parent.name)
    return root


def test_predict_tta_all_folds_writes_labels_and_probabilities_on_the_input_grid(cv_run, two_cases, tmp_path):
    config, run, _ = cv_run
    root = two_cases
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(root), "--out", str(out),
                                      "--tta", "--folds", "all", "--save-probabilities"])
    assert result.exit_code == 0, result.output
    plan = load_plan(run / "postprocessing.json")  # made by the cv, applied by default
    cases = discover_cases(root)
    assert len(cases) == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{c.case_id}{suffix}" for c in cases for suffix in (".nii.gz", ".npz"))
    for case in cases:
        written, source = nib.load(out / f"{case.case_id}.nii.gz"), nib.load(case.images["t1"])
        assert written.shape == source.shape
        np.testing.assert_array_equal(written.affine, source.affine)
        assert written.get_data_dtype() == np.uint8
        labels = np.asarray(written.dataobj)
        assert set(np.unique(labels).tolist()) <= LEGACY_LABELS and labels.any()
        with np.load(out / f"{case.case_id}.npz") as saved:
            probabilities, channels, outputs = saved["probabilities"], list(saved["channels"]), str(saved["outputs"])
        assert probabilities.dtype == np.float32 and probabilities.shape == (3, *source.shape)
        assert 0.0 <= probabilities.min() and probabilities.max() <= 1.0
        assert outputs == config.model.outputs and channels == output_names(case.edition, outputs)
        # The labels are the saved probabilities' labels under the run's postprocessing, exactly.
        raw = np.asarray(labels_from_probs(probabilities, case.edition, outputs, config.evaluate.threshold))
        np.testing.assert_array_equal(labels, apply(plan, raw))


def test_all_folds_average_the_fold_probabilities_and_load_each_model_once(cv_run, two_cases, tmp_path, monkeypatch):
    _, run, _ = cv_run
    root = two_cases
    loads = []
    original = predicting.load_for_inference
    monkeypatch.setattr(predicting, "load_for_inference",
                        lambda run_dir, fold, *args: loads.append(fold) or original(run_dir, fold, *args))
    written = predicting.predict(run, root, tmp_path / "all", "all", probabilities=True, progress=False)
    assert len(written) == len(discover_cases(root)) and loads == [0, 1]  # once per fold, for all cases
    for k in (0, 1):
        predicting.predict(run, root, tmp_path / f"fold{k}", k, probabilities=True, progress=False)
    for path in written:
        name = path.name.replace(".nii.gz", ".npz")
        folds = [np.load(tmp_path / f"fold{k}" / name)["probabilities"] for k in (0, 1)]
        np.testing.assert_allclose(np.load(tmp_path / "all" / name)["probabilities"], (folds[0] + folds[1]) / 2,
                                   rtol=0, atol=1e-6)
        assert not np.allclose(folds[0], folds[1])  # two different models: the average is not either one


def test_tta_changes_the_probabilities_and_postprocessing_can_be_turned_off(cv_run, tmp_path):
    _, run, root = cv_run
    case = discover_cases(root)[0]
    plain = predicting.predict(run, case.seg.parent, tmp_path / "plain", probabilities=True, postprocess=False,
                                 progress=False)[0]
    mirrored = predicting.predict(run, case.seg.parent, tmp_path / "tta", tta=True, probabilities=True,
                                    postprocess=False, progress=False)[0]
    plain_probs = np.load(plain.with_name(f"{case.case_id}.npz"))["probabilities"]
    tta_probs = np.load(mirrored.with_name(f"{case.case_id}.npz"))["probabilities"]
    assert np.abs(plain_probs - tta_probs).max() > 1e-4
    # Without postprocessing the labels are the probabilities' labels as they are.
    config = load_run_config(run)
    raw = labels_from_probs(plain_probs, case.edition, config.model.outputs, config.evaluate.threshold)
    np.testing.assert_array_equal(np.asarray(nib.load(plain).dataobj), raw)


def test_predict_rejects_a_fold_without_a_checkpoint_in_one_line(cv_run, tmp_path):
    _, run, root = cv_run
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(root), "--out", str(tmp_path),
                                      "--folds", "0,5"])
    assert result.exit_code == 2
    assert "--folds" in result.output and "fold_5" in result.output and "folds that have one: 0, 1" in result.output
    assert not list(tmp_path.iterdir())


def test_evaluate_run_with_tta_writes_the_official_metrics_next_to_the_legacy_ones(cv_run, tmp_path):
    _, run, _ = cv_run
    run = copy_run(run, tmp_path / "run")  # evaluation rewrites the fold's predictions and reports
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run), "--fold", "1", "--tta"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "8-mirror TTA" in result.output and "Lesion Dice" in result.output and "Sensitivity" in result.output
    fold = run / "fold_1"
    with open(fold / "official.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    groups = {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}
    assert list(rows[0]) == ["case", *official_columns(groups)]
    with open(fold / "metrics.csv", newline="") as handle:
        assert [row["case"] for row in rows] == [row["case"] for row in csv.DictReader(handle)]
    summary_md = (fold / "summary.md").read_text()
    assert "| WT |" in summary_md and "## Official BraTS metrics" in summary_md and "Lesion Dice" in summary_md


def test_evaluate_predictions_scores_the_ground_truth_perfectly_on_both_metric_sets(cv_run, tmp_path):
    import json

    _, _, root = cv_run
    predictions = tmp_path / "predictions"
    predictions.mkdir()
    cases = discover_cases(root)
    for case in cases:
        shutil.copy(case.seg, predictions / f"{case.case_id}.nii.gz")
    evaluate_predictions(predictions, root, tmp_path / "report", hd95=False, progress=False)
    with open(tmp_path / "report" / "official.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["case"] for row in rows] == [case.case_id for case in cases]
    for row in rows:
        for group in ("wt", "tc", "et"):
            if int(row[f"all_instance_tp_{group}"]):  # the group has lesions in this case
                assert float(row[f"lesionwise_dsc_mean_{group}"]) == 1.0 and float(row[f"global_dsc_{group}"]) == 1.0
                assert int(row[f"all_instance_fp_{group}"]) == int(row[f"all_instance_fn_{group}"]) == 0
            else:  # nothing on either side: undefined, left out of the means
                assert row[f"lesionwise_dsc_mean_{group}"] == "nan"
    official = json.loads((tmp_path / "report" / "official_summary.json").read_text(),
                          parse_constant=lambda constant: pytest.fail(f"non-JSON constant {constant}"))
    assert official["cases"] == len(cases) and official["summary"]["global_dsc_wt"]["mean"] == 1.0
    assert "## Official BraTS metrics" in (tmp_path / "report" / "summary.md").read_text()


def test_a_case_of_another_label_table_is_a_one_line_error(cv_run, tmp_path):
    from brats_swap.data.phantom import synthesize_dataset

    _, run, _ = cv_run
    ped = tmp_path / "ped"
    (case_id,) = synthesize_dataset(ped, 1, seed=3, edition="ped", shape=(40, 40, 32))
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(ped), "--out", str(tmp_path / "out"),
                                      "--no-postprocessing"])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and case_id in errors[0] and "3 channels" in errors[0] and "ped" in errors[0]


# ---- results you can trust: every case counted, bad cases listed, the others done -----------------------------


def test_evaluate_predictions_refuses_missing_cases_or_scores_them_as_empty(cv_run, tmp_path):
    _, _, root = cv_run
    cases = discover_cases(root)
    predictions = tmp_path / "predictions"
    predictions.mkdir()
    for case in cases[:2]:
        shutil.copy(case.seg, predictions / f"{case.case_id}.nii.gz")
    shutil.copy(cases[0].seg, predictions / "BraTS2021_09999.nii.gz")  # a prediction without a reference case
    missing = [case.case_id for case in cases[2:]]
    report = tmp_path / "report"

    refused = CliRunner().invoke(app, ["evaluate", "--predictions", str(predictions), "--data", str(root),
                                       "--out", str(report)])
    assert refused.exit_code == 1
    (error,) = [line for line in refused.output.splitlines() if line.startswith("error:")]
    assert "no prediction for 2 of 4 reference cases" in error and all(case_id in error for case_id in missing)
    assert "--missing empty" in error and not report.exists()  # refused before anything is written

    scored = CliRunner().invoke(app, ["evaluate", "--predictions", str(predictions), "--data", str(root),
                                      "--out", str(report), "--missing", "empty"], env={"COLUMNS": "200"})
    assert scored.exit_code == 0, scored.output
    output = " ".join(scored.output.split())
    assert f"scored as empty (no prediction): {', '.join(missing)}" in output
    assert "not scored (no reference case): BraTS2021_09999" in output
    for name in ("metrics.csv", "official.csv"):
        with open(report / name, newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert [row["case"] for row in rows] == [case.case_id for case in cases], name
    with open(report / "metrics.csv", newline="") as handle:
        dice = {row["case"]: float(row["dice_wt"]) for row in csv.DictReader(handle)}
    assert dice == {case.case_id: 0.0 if case.case_id in missing else 1.0 for case in cases}
    summary_md = (report / "summary.md").read_text()
    assert all(f"no prediction, scored as empty: {case_id}" in summary_md for case_id in missing)
    assert "prediction without a reference case, not scored: BraTS2021_09999" in summary_md


def test_predict_writes_every_good_case_and_exits_1_naming_the_broken_one(cv_run, two_cases, tmp_path):
    _, run, _ = cv_run
    root = tmp_path / "cases"
    shutil.copytree(two_cases, root)
    good, broken = discover_cases(root)
    broken.images["t2"].unlink()  # a case without one of its modalities
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["predict", "--run", str(run), "--input", str(root), "--out", str(out),
                                      "--folds", "0", "--no-postprocessing"])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "1 of 2 case(s) failed" in errors[0] and broken.case_id in errors[0]
    assert "t2" in errors[0] and good.case_id not in errors[0] and "Traceback" not in result.output
    assert f"skipped case {broken.case_id}" in " ".join(result.output.split())
    assert sorted(path.name for path in out.iterdir()) == [f"{good.case_id}.nii.gz"]


def test_predict_says_what_postprocessing_removed_per_case(cv_run, tmp_path, capsys):
    from dataclasses import replace

    from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan, relabel_labels, save_plan

    _, run, root = cv_run
    run = copy_run(run, tmp_path / "run")
    identity = PostprocessingPlan.identity({"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}, relabel_labels("2021"))
    save_plan(replace(identity, min_component_voxels={"WT": 10**9, "TC": 0, "ET": 0}), run / "postprocessing.json")
    case = discover_cases(root)[0]
    raw = predicting.predict(run, case.seg.parent, tmp_path / "raw", 0, postprocess=False, progress=False)[0]
    counts = {value: int(np.count_nonzero(np.asarray(nib.load(raw).dataobj) == value)) for value in (1, 2, 4)}
    predicting.predict(run, case.seg.parent, tmp_path / "processed", 0, progress=True)
    said = " ".join(capsys.readouterr().err.split())  # progress lines go to stderr
    removed = "; ".join(f"label {value}: {count} -> 0 voxels" for value, count in counts.items() if count)
    assert f"{case.case_id}: postprocessing {removed}" in said


def test_a_plan_of_no_rule_is_said_once_not_per_case(cv_run, tmp_path, capsys):
    """issue 44.7: "no postprocessing" and then "postprocessing changed nothing" for every case."""
    from brats_swap.evaluate.postprocessing_rules import PostprocessingPlan, relabel_labels, save_plan

    _, run, root = cv_run
    run = copy_run(run, tmp_path / "run")
    identity = PostprocessingPlan.identity({"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)}, relabel_labels("2021"))
    assert not identity.active and identity.describe() == "no postprocessing"
    save_plan(identity, run / "postprocessing.json")
    case = discover_cases(root)[0]
    predicting.predict(run, case.seg.parent, tmp_path / "out", 0, progress=True)
    said = " ".join(capsys.readouterr().err.split())
    assert "postprocessing: no postprocessing" in said and f"{case.case_id}: postprocessing" not in said


def test_evaluate_run_scores_the_good_cases_and_exits_1_naming_a_bad_one(cv_run, tmp_path):
    _, run, root = cv_run
    run = copy_run(run, tmp_path / "run")  # evaluation rewrites the fold's predictions and reports
    data = tmp_path / "data"
    shutil.copytree(root, data)
    bad, good = json.loads((run / "splits.json").read_text())["folds"][0]["val"]
    seg = next(case.seg for case in discover_cases(data) if case.case_id == bad)
    image = nib.load(seg)
    labels = np.asarray(image.dataobj).astype(np.uint8)
    labels[0, 0, 0] = 3  # not a 2021 label
    nib.save(nib.Nifti1Image(labels, image.affine), seg)
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run), "--folds", "0", "--data", str(data)])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "1 of 2 case(s) failed" in errors[0] and bad in errors[0] and "label value 3" in errors[0]
    with open(run / "fold_0" / "metrics.csv", newline="") as handle:
        assert [row["case"] for row in csv.DictReader(handle)] == [good]
    assert f"not scored: case {bad}" in (run / "fold_0" / "summary.md").read_text()
