"""The official BraTS lesion-wise metrics: the same configuration and the same numbers as the official
`brats-evaluation` package, run through its own command-line code on NIfTI phantoms."""

from __future__ import annotations

import json
import math
import sys

import nibabel as nib
import numpy as np
import pytest

from brats_swap.data.challenges import evaluation_groups
from brats_swap.errors import DataError
from brats_swap.evaluate.official import (
    HD95_PENALTY_MM,
    case_official_metrics,
    official_columns,
    official_evaluator,
    official_markdown_table,
    print_official_summary,
    summarize_official,
)

SHAPE = (48, 48, 48)
NETC, SNFH, ET, RC = 1, 2, 3, 4  # the GLI labels the phantoms are drawn with

# Official config name -> (our challenge-table key, GLI phantom label -> that challenge's label value).
CHALLENGES = {
    "gli": ("gli-post", {NETC: 1, SNFH: 2, ET: 3, RC: 4}),
    "mets": ("met", {NETC: 1, SNFH: 2, ET: 3, RC: 4}),
    "MenPre": ("men", {NETC: 1, SNFH: 2, ET: 3, RC: 0}),
    "GoAT": ("goat", {NETC: 1, SNFH: 2, ET: 3, RC: 0}),
    "MenRT": ("men-rt", {NETC: 1, SNFH: 1, ET: 1, RC: 1}),
    # PED: 1 ET, 2 NETC, 3 CC (cyst, drawn where the GLI phantom has its cavity), 4 ED.
    "ped": ("ped", {NETC: 2, SNFH: 4, ET: 1, RC: 3}),
}


def groups_of(config: str) -> dict[str, tuple[int, ...]]:
    return evaluation_groups(CHALLENGES[config][0])


def ball(center, radius) -> np.ndarray:
    grid = np.indices(SHAPE)
    return sum((grid[axis] - center[axis]) ** 2 for axis in range(3)) <= radius**2


def draw_tumour(volume: np.ndarray, center, radius: float) -> None:
    """Oedema ball, enhancing ball inside it, necrotic core inside that."""
    volume[ball(center, radius)] = SNFH
    volume[ball(center, 0.6 * radius)] = ET
    volume[ball(center, 0.3 * radius)] = NETC


def gli_phantoms() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Case id -> (reference, prediction) in GLI labels, covering the cases the official rules treat apart."""
    cases = {}
    ref, pred = np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8)
    # Several lesions: two tumours (the prediction shifted and shrunk), a cavity, a small enhancing
    # lesion the prediction misses, and a false-positive enhancing lesion plus an oedema speck.
    draw_tumour(ref, (14, 14, 14), 9)
    draw_tumour(pred, (15, 14, 13), 9)
    draw_tumour(ref, (34, 32, 30), 7)
    draw_tumour(pred, (34, 33, 30), 6)
    ref[ball((34, 11, 36), 4)] = RC
    pred[ball((35, 11, 36), 3)] = RC
    ref[ball((9, 38, 38), 2)] = ET
    pred[ball((42, 42, 8), 2)] = ET
    pred[ball((5, 42, 20), 1)] = SNFH
    cases["00001-000"] = (ref, pred)
    # One reference enhancing lesion predicted as two pieces: one is matched, the other is a false positive.
    ref, pred = np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8)
    ref[ball((24, 24, 24), 6)] = ET
    pred[ball((24, 24, 20), 3)] = ET
    pred[ball((24, 24, 28), 2)] = ET
    cases["00002-000"] = (ref, pred)
    # An empty prediction; an empty reference with a false-positive tumour; both empty.
    ref = np.zeros(SHAPE, np.uint8)
    draw_tumour(ref, (20, 25, 24), 8)
    cases["00003-000"] = (ref, np.zeros(SHAPE, np.uint8))
    pred = np.zeros(SHAPE, np.uint8)
    draw_tumour(pred, (30, 20, 24), 5)
    cases["00004-000"] = (np.zeros(SHAPE, np.uint8), pred)
    cases["00005-000"] = (np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8))
    # Random tumours, each predicted with a small shift and a different size.
    rng = np.random.default_rng(7)
    ref, pred = np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8)
    for _ in range(4):
        center = rng.integers(8, 40, size=3)
        radius = int(rng.integers(3, 7))
        draw_tumour(ref, center, radius)
        draw_tumour(pred, center + rng.integers(-1, 2, size=3), radius + int(rng.integers(-1, 2)))
    cases["00006-000"] = (ref, pred)
    return cases


def to_challenge(labels: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    lookup = np.zeros(256, np.uint8)
    for gli_label, label in mapping.items():
        lookup[gli_label] = label
    return lookup[labels]


def run_official_package(config: str, cases: dict, tmp_path, monkeypatch) -> dict[str, dict]:
    """The official package's two commands (brats-evaluate, brats-parse-metrics seg) on NIfTI files of
    `cases`; returns the CSV rows by subject id (file name) plus the "mean"/"std"/"median" rows."""
    pd = pytest.importorskip("pandas")
    from brats_evaluation import evaluation, metrics_parser

    ref_dir, pred_dir = tmp_path / "ref", tmp_path / "pred"
    ref_dir.mkdir()
    pred_dir.mkdir()
    for case_id, (ref, pred) in cases.items():
        nib.save(nib.Nifti1Image(ref, np.eye(4)), ref_dir / f"BraTS-X-{case_id}.nii.gz")
        nib.save(nib.Nifti1Image(pred, np.eye(4)), pred_dir / f"BraTS-X-{case_id}.nii.gz")
    summary_json, csv_path = tmp_path / "summary.json", tmp_path / "metrics.csv"
    monkeypatch.setattr(sys, "argv", ["brats-evaluate", "--config", config, "--ref_path", str(ref_dir),
                                      "--pred_path", str(pred_dir), "--summary_json", str(summary_json)])
    evaluation.main()
    report = json.loads(summary_json.read_text())
    assert report["missings"] == [] and not [m for m in report["metrics"] if "error" in m]
    monkeypatch.setattr(sys, "argv", ["brats-parse-metrics", "seg", "--json_path", str(summary_json),
                                      "--output_csv_path", str(csv_path)])
    metrics_parser.main()
    table = pd.read_csv(csv_path)
    return {str(row["subject_id"]): row.to_dict() for _, row in table.iterrows()}


def assert_same(ours: float, official: float, where: str) -> None:
    if math.isnan(official) or math.isinf(official):
        assert (math.isnan(ours) and math.isnan(official)) or ours == official, f"{where}: {ours} vs {official}"
    else:
        assert ours == pytest.approx(official, abs=1e-6), f"{where}: {ours} vs {official}"


@pytest.mark.parametrize("config", ["gli", "ped", "MenRT"])
def test_every_column_equals_the_official_package(config, tmp_path, monkeypatch):
    pytest.importorskip("brats_evaluation")
    groups, mapping = groups_of(config), CHALLENGES[config][1]
    cases = {case_id: (to_challenge(ref, mapping), to_challenge(pred, mapping))
             for case_id, (ref, pred) in gli_phantoms().items()}
    official = run_official_package(config, cases, tmp_path, monkeypatch)

    rows = []
    for case_id, (ref, pred) in cases.items():
        row = case_official_metrics(pred, ref, groups, spacing=(1.0, 1.0, 1.0))
        assert list(row) == official_columns(groups)
        expected = official[f"BraTS-X-{case_id}.nii.gz"]
        assert set(row) == set(expected) - {"subject_id"}
        for column, value in row.items():
            assert_same(value, expected[column], f"{config} {case_id} {column}")
        rows.append(row)
    summary = summarize_official(rows)
    for statistic in ("mean", "std", "median"):
        for column, stats in summary.items():
            assert_same(stats[statistic], official[statistic][column], f"{config} {statistic} {column}")


def test_the_phantoms_exercise_every_rule():
    """The comparison above means something only if the phantoms hit each edge case."""
    groups = groups_of("gli")
    cases = gli_phantoms()
    several = case_official_metrics(cases["00001-000"][1], cases["00001-000"][0], groups)
    assert several["all_instance_tp_et"] == 2 and several["all_instance_fp_et"] == 1
    assert several["all_instance_fn_et"] == 1
    assert several["all_instance_f1_et"] == pytest.approx(2 / (2 + 0.5 * (1 + 1)))
    assert 0 < several["lesionwise_dsc_mean_et"] < 1 and several["all_instance_tp_rc"] == 1
    split = case_official_metrics(cases["00002-000"][1], cases["00002-000"][0], groups)
    assert (split["all_instance_tp_et"], split["all_instance_fp_et"]) == (1, 1)
    empty_pred = case_official_metrics(cases["00003-000"][1], cases["00003-000"][0], groups)
    assert empty_pred["global_dsc_wt"] == 0 and empty_pred["global_hd95_wt"] == HD95_PENALTY_MM
    assert empty_pred["lesionwise_dsc_mean_wt"] == 0 and math.isinf(empty_pred["lesionwise_hd95_mean_wt"])
    assert empty_pred["all_instance_fn_wt"] == 1 and math.isnan(empty_pred["all_instance_prec_wt"])
    empty_ref = case_official_metrics(cases["00004-000"][1], cases["00004-000"][0], groups)
    assert empty_ref["all_instance_fp_wt"] == 1 and empty_ref["all_instance_f1_wt"] == 0
    both_empty = case_official_metrics(cases["00005-000"][1], cases["00005-000"][0], groups)
    assert all(math.isnan(both_empty[f"{stem}_wt"]) for stem in ("global_dsc", "lesionwise_dsc_mean", "all_instance_f1"))
    assert both_empty["all_instance_tp_wt"] == 0


@pytest.mark.parametrize("config", sorted(CHALLENGES))
def test_configuration_equals_the_bundled_official_config(config, tmp_path):
    """Serialised by panoptica, our evaluator with the groups of our challenge table and the official YAML
    of each challenge are the same text."""
    pytest.importorskip("brats_evaluation")
    from brats_evaluation import config_path
    from panoptica import Panoptica_Evaluator

    official = Panoptica_Evaluator.load_from_config(str(config_path(config)))
    official.save_to_config(tmp_path / "official.yaml")
    official_evaluator(groups_of(config)).save_to_config(tmp_path / "ours.yaml")
    assert (tmp_path / "ours.yaml").read_text() == (tmp_path / "official.yaml").read_text()


def test_lesionwise_distances_follow_the_spacing_of_each_array_axis():
    """A plate two voxels thick, shifted by one voxel along the third axis: its lesion-wise HD95 is that
    axis's spacing. The global HD95 stays in voxels (panoptica computes it without the spacing)."""
    groups = {"GTV": (1,)}
    ref, pred = np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8)
    ref[10:30, 10:30, 20:22] = 1
    pred[10:30, 10:30, 21:23] = 1
    along_z = case_official_metrics(pred, ref, groups, spacing=(1.0, 1.0, 3.0))
    along_x = case_official_metrics(pred, ref, groups, spacing=(3.0, 1.0, 1.0))
    assert along_z["lesionwise_hd95_mean_gtv"] == pytest.approx(3.0)
    assert along_x["lesionwise_hd95_mean_gtv"] == pytest.approx(1.0)
    assert along_z["global_hd95_gtv"] == along_x["global_hd95_gtv"] == pytest.approx(1.0)


def test_labels_outside_the_groups_and_shape_mismatch_are_one_line_errors():
    groups = groups_of("MenPre")
    ref = np.zeros(SHAPE, np.uint8)
    pred = ref.copy()
    pred[3, 3, 3] = 4
    with pytest.raises(DataError, match=r"^case 7: prediction: labels \[4\] are in no evaluation group"):
        case_official_metrics(pred, ref, groups, what="case 7")
    with pytest.raises(DataError, match="differ in shape"):
        case_official_metrics(pred[:-1], ref, groups)


def test_summary_table_shows_means_and_lesion_totals():
    groups = groups_of("gli")
    rows = [case_official_metrics(pred, ref, groups) for ref, pred in gli_phantoms().values()]
    summary = summarize_official(rows)
    assert summary["all_instance_tp_et"]["total"] == sum(row["all_instance_tp_et"] for row in rows)
    assert summary["global_dsc_wt"]["n"] == 5  # the lesion-free case is left out
    table = official_markdown_table(summary, groups)
    lines = table.strip().splitlines()
    assert lines[0].startswith("| Group | Dice |") and len(lines) == 2 + len(groups)
    et_row = next(line for line in lines if line.startswith("| ET |"))
    assert f"{summary['global_dsc_et']['mean']:.3f}" in et_row

    from rich.console import Console

    console = Console(record=True, width=200)
    print_official_summary(summary, groups, console, title="official")
    assert "Lesion Dice" in console.export_text()


def test_each_table_says_its_rule_and_never_shows_an_infinite_mean(tmp_path):
    """Issue 54: the legacy and the official tables score the same predictions differently, each says which
    rule it follows in one line; a mean over cases is never "inf": the infinite cases are counted instead."""
    from brats_swap.evaluate.metrics import LEGACY_RULE, write_metrics_report
    from brats_swap.evaluate.official import OFFICIAL_RULE, official_columns

    groups = {"ET": (4,)}
    official_rows = []
    for case, (dsc, hd95) in {"a": (0.8, 4.0), "b": (0.6, 6.0), "c": (0.0, math.inf)}.items():
        row = {"case": case, **{column: 1.0 for column in official_columns(groups)}}
        row.update(lesionwise_dsc_mean_et=dsc, lesionwise_hd95_mean_et=hd95)
        official_rows.append(row)
    table = official_markdown_table(summarize_official(official_rows), groups)
    et = next(line for line in table.splitlines() if line.startswith("| ET "))
    assert "| 5.00 (+1 inf) |" in et and "inf |" not in et.replace("(+1 inf) |", "")

    legacy_rows = [{"case": "a", "dice_et": 0.8, "hd95_et": 4.0}, {"case": "b", "dice_et": 0.6, "hd95_et": math.inf}]
    write_metrics_report(legacy_rows, tmp_path, "t", official_rows=official_rows, groups=groups)
    markdown = (tmp_path / "summary.md").read_text()
    assert LEGACY_RULE in markdown and OFFICIAL_RULE in markdown
    assert markdown.index(LEGACY_RULE) < markdown.index("## Official") < markdown.index(OFFICIAL_RULE)
    assert "| 4.00 (+1 inf) |" in markdown
    assert " inf |" not in markdown.replace("(+1 inf) |", "")  # no bare infinite mean in any cell
