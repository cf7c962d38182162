"""Evaluation: sliding window vs whole cube, predictions on the original grid, scoring any tool's output."""

from __future__ import annotations

import csv
import json
import shutil

import nibabel as nib
import numpy as np
import pytest
import torch
from train_helpers import prepared_dataset, tiny_config
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.data.discovery import discover_cases
from brats_swap.errors import DataError
from brats_swap.evaluate.predicting import predict
from brats_swap.evaluate.scoring import evaluate_fold, evaluate_predictions
from brats_swap.run.inference import predict_full, predict_sliding_window
from brats_swap.train.loop import train_fold


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def trained_run(data, tmp_path_factory):
    run = tmp_path_factory.mktemp("eval") / "run"
    config = tiny_config(*data)
    train_fold(config, run, 0, progress=False)
    return config, run


def test_sliding_window_equals_whole_cube_when_the_receptive_field_fits():
    # A 1x1x1 convolution sees one voxel: every window predicts exactly what the whole cube does, so
    # Gaussian blending of overlapping windows must give back the same probabilities.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv3d(4, 3, kernel_size=1), torch.nn.Sigmoid()).eval()
    image = torch.randn(1, 4, 24, 16, 32)
    full = predict_full(model, image, device=torch.device("cpu"))
    for blend in ("gaussian", "constant"):
        windowed = predict_sliding_window(model, image, roi_size=(16, 8, 16), device=torch.device("cpu"),
                                          overlap=0.5, blend=blend)
        assert windowed.shape == full.shape == (1, 3, 24, 16, 32)
        torch.testing.assert_close(windowed, full, rtol=1e-5, atol=1e-6)


def test_evaluate_writes_predictions_on_the_original_grid_and_metrics(trained_run, data):
    config, run = trained_run
    root, _ = data
    summary = evaluate_fold(config, run, 0, progress=False)
    fold = run / "fold_0"
    val_ids = json.loads((run / "splits.json").read_text())["folds"][0]["val"]
    with open(fold / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["case"] for r in rows] == val_ids
    assert {"dice_wt", "sensitivity_tc", "specificity_et"} <= set(rows[0])
    assert json.loads((fold / "summary.json").read_text()) == summary
    assert summary["dice_wt"]["n"] == len(val_ids)
    cases = {c.case_id: c for c in discover_cases(root)}
    for case_id in val_ids:
        prediction = nib.load(fold / "predictions" / f"{case_id}.nii.gz")
        source = nib.load(cases[case_id].images["t1"])
        assert prediction.shape == source.shape
        np.testing.assert_allclose(prediction.affine, source.affine)
        assert set(np.unique(np.asarray(prediction.dataobj))) <= {0, 1, 2, 4}


def test_ground_truth_scored_as_prediction_gives_dice_one(data, tmp_path):
    root, _ = data
    predictions = tmp_path / "nnunet_out"
    predictions.mkdir()
    for case in discover_cases(root):
        shutil.copy(case.seg, predictions / f"{case.case_id}.nii.gz")
    result = CliRunner().invoke(app, ["evaluate", "--predictions", str(predictions), "--data", str(root),
                                      "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    for region in ("wt", "tc", "et"):
        assert summary[f"dice_{region}"]["mean"] == 1.0
        assert summary[f"dice_{region}"]["n"] == 4
    assert "WT" in result.output


def test_a_prediction_with_foreign_labels_fails_after_the_other_cases_are_scored(data, tmp_path):
    root, _ = data
    cases = discover_cases(root)
    for case in cases[1:]:
        shutil.copy(case.seg, tmp_path / f"{case.case_id}.nii.gz")
    truth = nib.load(cases[0].seg)
    bad = np.asarray(truth.dataobj).astype(np.uint8)
    bad[0, 0, 0] = 3  # label 3 does not exist in the 2021 convention
    nib.save(nib.Nifti1Image(bad, truth.affine), tmp_path / f"{cases[0].case_id}.nii.gz")
    with pytest.raises(DataError, match=f"1 of 4 case.*{cases[0].case_id}.*label value 3"):
        evaluate_predictions(tmp_path, root, tmp_path / "report", hd95=False, progress=False)
    # Every reference case has its row; the bad file is scored as empty (Dice 0), the others as perfect.
    with open(tmp_path / "report" / "metrics.csv") as handle:
        dice = {row["case"]: float(row["dice_wt"]) for row in csv.DictReader(handle)}
    assert dice == {case.case_id: 0.0 if case is cases[0] else 1.0 for case in cases}
    assert f"failed: case {cases[0].case_id}" in (tmp_path / "report" / "summary.md").read_text()


def test_predict_segments_a_new_case_folder_on_its_own_grid(trained_run, data, tmp_path):
    _, run = trained_run
    root, _ = data
    case = discover_cases(root)[0]
    written = predict(run, case.seg.parent, tmp_path / "out", progress=False)
    assert [p.name for p in written] == [f"{case.case_id}.nii.gz"]
    out, source = nib.load(written[0]), nib.load(case.images["flair"])
    assert out.shape == source.shape
    np.testing.assert_allclose(out.affine, source.affine)


def test_evaluate_cli_prints_the_region_table(trained_run):
    _, run = trained_run
    result = CliRunner().invoke(app, ["evaluate", "--run", str(run), "--fold", "0"])
    assert result.exit_code == 0, result.output
    for region in ("WT", "TC", "ET"):
        assert region in result.output
