"""BraTS metrics: every empty/non-empty combination by hand, medpy agreement, and the report files."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from medpy.metric import binary as medpy_binary

from brats_swap.data.challenges import get_challenge
from brats_swap.evaluate.metrics import (
    case_metrics,
    dice_sensitivity_specificity,
    grid_diagonal_mm,
    hausdorff95,
    markdown_table,
    metric_keys,
    print_summary,
    summarize,
    write_metrics_report,
)

SHAPE = (10, 12, 8)


def mask(*points) -> np.ndarray:
    out = np.zeros(SHAPE, dtype=bool)
    for p in points:
        out[p] = True
    return out


# -- hand-made masks, every empty/non-empty combination ----------------------------------------------------


def test_both_empty():
    empty = mask()
    assert dice_sensitivity_specificity(empty, empty) == (1.0, 1.0, 1.0)
    assert hausdorff95(empty, empty) == 0.0


def test_truth_empty_prediction_not():
    pred = mask((1, 1, 1), (2, 2, 2))
    dice, sens, spec = dice_sensitivity_specificity(pred, mask())
    assert dice == 0.0 and sens == 0.0
    assert spec == pytest.approx((pred.size - 2) / pred.size)
    assert hausdorff95(pred, mask()) == pytest.approx(math.sqrt(10**2 + 12**2 + 8**2))


def test_prediction_empty_truth_not():
    truth = mask((3, 3, 3))
    dice, sens, spec = dice_sensitivity_specificity(mask(), truth)
    assert (dice, sens, spec) == (0.0, 0.0, 1.0)
    assert hausdorff95(mask(), truth, spacing=(2.0, 1.0, 1.0)) == pytest.approx(math.sqrt(20**2 + 12**2 + 8**2))


def test_both_non_empty():
    truth = mask((1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 1, 4))
    pred = mask((1, 1, 1), (1, 1, 2), (5, 5, 5))
    dice, sens, spec = dice_sensitivity_specificity(pred, truth)
    assert dice == pytest.approx(2 * 2 / (3 + 4))
    assert sens == pytest.approx(2 / 4)
    negatives = truth.size - 4
    assert spec == pytest.approx((negatives - 1) / negatives)


def test_hd95_single_voxels_with_spacing():
    a, b = mask((2, 5, 5)), mask((5, 5, 5))
    assert hausdorff95(a, b) == pytest.approx(3.0)
    assert hausdorff95(a, b, spacing=(2.0, 1.0, 1.0)) == pytest.approx(6.0)
    assert hausdorff95(a, a) == 0.0


def test_hd95_shifted_box_agrees_with_medpy():
    a = np.zeros((30, 30, 30), dtype=bool)
    a[8:20, 10:22, 9:17] = True
    b = np.roll(a, 2, axis=0)
    assert hausdorff95(a, b) == pytest.approx(medpy_binary.hd95(a, b), abs=1e-6)
    assert hausdorff95(a, b) == pytest.approx(2.0)


def test_brats_diagonal_penalty():
    assert grid_diagonal_mm((240, 240, 155), (1, 1, 1)) == pytest.approx(373.13, abs=0.01)


# -- agreement with medpy on random non-empty masks ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_against_medpy_on_random_masks(seed):
    rng = np.random.default_rng(seed)
    pred = rng.random(SHAPE) < rng.uniform(0.05, 0.5)
    truth = rng.random(SHAPE) < rng.uniform(0.05, 0.5)
    dice, sens, spec = dice_sensitivity_specificity(pred, truth)
    assert dice == pytest.approx(medpy_binary.dc(pred, truth))
    assert sens == pytest.approx(medpy_binary.sensitivity(pred, truth))
    assert spec == pytest.approx(medpy_binary.specificity(pred, truth))


# -- whole cases ---------------------------------------------------------------------------------------------


def test_case_metrics_regions_and_keys():
    spec = get_challenge("2021")
    truth = np.zeros(SHAPE, dtype=np.uint8)
    truth[2:6, 2:6, 2:6] = spec.edema
    truth[3:5, 3:5, 3:5] = 1  # core
    pred = truth.copy()
    pred[pred == 1] = spec.edema  # the core predicted as edema: WT perfect, TC and ET empty in the prediction
    result = case_metrics(pred, truth, "2021")
    assert list(result) == metric_keys(hd95=True)
    assert result["dice_wt"] == 1.0 and result["sensitivity_wt"] == 1.0 and result["hd95_wt"] == 0.0
    assert result["dice_tc"] == 0.0 and result["sensitivity_tc"] == 0.0
    assert result["hd95_tc"] == pytest.approx(grid_diagonal_mm(SHAPE, (1, 1, 1)))
    # No enhancing tumour anywhere: BraTS scores the case as perfect.
    assert (result["dice_et"], result["sensitivity_et"], result["specificity_et"], result["hd95_et"]) == (
        1.0, 1.0, 1.0, 0.0)
    # Torch input and no HD95.
    short = case_metrics(torch.from_numpy(pred), torch.from_numpy(truth), spec, hd95=False)
    assert list(short) == metric_keys(hd95=False) and "hd95_wt" not in short
    assert short["dice_tc"] == result["dice_tc"]


def test_case_metrics_2023_labels():
    truth = np.zeros(SHAPE, dtype=np.uint8)
    truth[1:4, 1:4, 1:4] = 3  # ET in 2023
    result = case_metrics(truth, truth, "2023", hd95=False)
    assert result["dice_et"] == result["dice_tc"] == result["dice_wt"] == 1.0
    shifted = np.roll(truth, 1, axis=0)
    assert case_metrics(shifted, truth, "2023", hd95=False)["dice_et"] == pytest.approx(2 * 18 / 54)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        case_metrics(np.zeros((4, 4, 4), np.uint8), np.zeros((4, 4, 5), np.uint8), "2021")


# -- summaries and reports ------------------------------------------------------------------------------------


def make_rows(n: int = 4, hd95: bool = True) -> list[dict]:
    rows = []
    for i in range(n):
        row = {"case": f"case_{i:03d}"}
        row.update({key: 0.1 * (i + 1) for key in metric_keys(hd95)})
        rows.append(row)
    return rows


def test_summarize():
    rows = make_rows(4)
    rows[0]["hd95_et"] = float("nan")  # left out of the statistics
    summary = summarize(rows)
    assert list(summary) == metric_keys(True)
    dice = summary["dice_wt"]
    assert dice["n"] == 4
    assert dice["mean"] == pytest.approx(0.25)
    assert dice["median"] == pytest.approx(0.25)
    assert dice["std"] == pytest.approx(float(np.std([0.1, 0.2, 0.3, 0.4], ddof=1)))  # the sample std
    assert summary["hd95_et"]["n"] == 3 and summary["hd95_et"]["mean"] == pytest.approx(0.3)


def test_write_metrics_report(tmp_path):
    rows = make_rows(3)
    summary = write_metrics_report(rows, tmp_path / "report", title="fold 0")
    out = tmp_path / "report"
    with open(out / "metrics.csv", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader)
        body = list(reader)
    assert header == ["case", "dice_wt", "dice_tc", "dice_et", "sensitivity_wt", "sensitivity_tc",
                      "sensitivity_et", "specificity_wt", "specificity_tc", "specificity_et",
                      "hd95_wt", "hd95_tc", "hd95_et"]
    assert [r[0] for r in body] == ["case_000", "case_001", "case_002"]
    assert float(body[1][1]) == pytest.approx(0.2)
    assert json.loads((out / "summary.json").read_text()) == summary
    md = (out / "summary.md").read_text()
    assert md.startswith("# fold 0") and "| WT |" in md and "0.200 ± 0.100" in md
    png = (out / "dice_boxplot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.tmp"))


def test_report_without_hd95_and_tables():
    rows = make_rows(2, hd95=False)
    summary = summarize(rows)
    table = markdown_table(summary)
    assert table.splitlines()[0] == "| Region | Dice | Sensitivity | Specificity |"
    assert len(table.splitlines()) == 5
    from rich.console import Console

    console = Console(record=True, width=100)
    print_summary(summary, console, title="demo")
    text = console.export_text()
    assert "WT" in text and "0.150 ± 0.071" in text and "2 cases" in text
