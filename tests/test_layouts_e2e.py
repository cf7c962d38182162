"""nnU-Net raw and Decathlon folders end to end through the CLI: `data check --strict`, `train` (which
prepares the cache), `evaluate` of the run, `predict` in the dataset's own label values and `evaluate
--predictions --dataset-labels` give what the BraTS-named originals give.

Tiny on purpose (4 cases of 40x40x24, a 24³ cube, 4 base filters, one step): one run on nnU-Net's BraTS 2021
conversion serves the Decathlon folder too (same table values), one on a 2023 GLI conversion.
"""

from __future__ import annotations

import csv

import nibabel as nib
import numpy as np
from layout_helpers import BRATS_TO_MSD, to_msd_task01, to_nnunet_brats21, to_nnunet_kept
from typer.testing import CliRunner

from brats_swap.cli.main import app
from brats_swap.data.phantom import synthesize_dataset

TINY = ["data.cube=[24,24,24]", "model.depth=4", "model.base_filters=4", "train.max_epochs=1",
        "train.steps_per_epoch=1", "train.device=cpu", "cv.folds=2", "data.loader_workers=0",
        "data.prepare_workers=1", "evaluate.hd95=false"]


def _invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"{' '.join(args[:2])}: exit {result.exit_code}\n{result.output}"
    return result


def _sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def _rows(path):
    with open(path, newline="") as handle:
        return [{k: v for k, v in row.items() if k != "case"} for row in csv.DictReader(handle)]


def _check(root):
    # One process: the pool's answers are tests/test_data_scale.py's (two spawned workers cost ~3 s of CPU here).
    _invoke("data", "check", str(root), "--strict", "--workers", "1")


def _train(root, tmp_path, name):
    _check(root)
    run = tmp_path / f"run-{name}"
    _invoke("train", "--run", str(run), *_sets(f"data.root={root}", f"data.cache={tmp_path / f'cache-{name}'}", *TINY))
    _invoke("evaluate", "--run", str(run))
    assert (run / "fold_0" / "summary.json").is_file()
    return run


def test_nnunet_brats21_and_decathlon_folders_train_predict_and_evaluate(tmp_path):
    brats = tmp_path / "brats"
    synthesize_dataset(brats, 4, seed=5, edition="2021", shape=(40, 40, 24))
    nnunet = to_nnunet_brats21(brats, tmp_path / "Dataset137_BraTS2021")
    run = _train(nnunet, tmp_path, "nnunet")

    names = to_msd_task01(brats, tmp_path / "Task01_BrainTumour")
    _check(tmp_path / "Task01_BrainTumour")
    _invoke("predict", "--run", str(run), "--input", str(brats), "--out", str(tmp_path / "pred-brats"))
    _invoke("predict", "--run", str(run), "--input", str(tmp_path / "Task01_BrainTumour"), "--out",
            str(tmp_path / "pred-msd"), "--dataset-labels")
    for msd_id, case_id in names.items():  # the same labels, in the Decathlon's values
        original = np.asarray(nib.load(tmp_path / "pred-brats" / f"{case_id}.nii.gz").dataobj)
        written = np.asarray(nib.load(tmp_path / "pred-msd" / f"{msd_id}.nii.gz").dataobj)
        expected = np.zeros_like(original)
        for brats_value, msd_value in BRATS_TO_MSD.items():
            expected[original == brats_value] = msd_value
        assert np.array_equal(written, expected)
    assert any(np.any(np.asarray(nib.load(p).dataobj)) for p in (tmp_path / "pred-msd").glob("*.nii.gz"))

    _invoke("evaluate", "--predictions", str(tmp_path / "pred-brats"), "--data", str(brats), "--out",
            str(tmp_path / "report-brats"))
    _invoke("evaluate", "--predictions", str(tmp_path / "pred-msd"), "--data", str(tmp_path / "Task01_BrainTumour"),
            "--out", str(tmp_path / "report-msd"), "--dataset-labels")
    assert _rows(tmp_path / "report-msd" / "metrics.csv") == _rows(tmp_path / "report-brats" / "metrics.csv")


def test_a_2023_nnunet_conversion_trains_and_evaluates(tmp_path):
    gli = tmp_path / "gli"
    synthesize_dataset(gli, 4, seed=5, edition="gli", shape=(40, 40, 24))
    run = _train(to_nnunet_kept(gli, tmp_path / "Dataset226_GLI"), tmp_path, "gli")
    header = (run / "fold_0" / "metrics.csv").read_text().splitlines()[0]
    assert "dice_wt" in header
