"""BraTS metrics per case and region (WT, TC, ET; + RC, CC or GTV for the 2023+ challenges that have them: a
run's regions), with the CaPTk rules for empty masks, and the reports.

Per region, on the binary masks P (prediction) and T (truth) of one case, over the whole grid given:

    Dice         2|P∩T| / (|P|+|T|)          1 if both are empty (so 0 if exactly one is empty)
    sensitivity  |P∩T| / |T|                 1 if both are empty, 0 if T is empty and P is not
    specificity  TN / (TN+FP)                over every voxel of the grid (not a brain mask);
                                             1 if T covers the whole grid (no negatives to get wrong)
    HD95 (mm)    95th-percentile Hausdorff   0 if both are empty; the grid's diagonal in mm if exactly
                                             one is empty (373.13 for 240x240x155 at 1 mm)

These are the BraTS 2017-2021 conventions of CaPTk, the challenge's scoring tool in those years. MONAI's
DiceMetric/ConfusionMatrixMetric would return NaN for empty truth and drop those cases from the mean, so
the counts are done here directly; HD95 uses MONAI's `compute_hausdorff_distance` (the maximum of the
two directed 95th percentiles of the surface distances, as the challenge tools compute it).
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.data.challenges import REGIONS, ChallengeSpec, get_challenge, isin
from brats_swap.evaluate.official import (
    OFFICIAL_RULE,
    Groups,
    json_safe,
    official_markdown_table,
    write_official_report,
)
from brats_swap.evaluate.tables import print_results_table
from brats_swap.model.targets import region_names
from brats_swap.run.dice import dice_sensitivity_specificity, regions_of_columns
from brats_swap.run.figures import dice_boxplot
from brats_swap.run.summary_stats import STD_NOTE, sample_std

METRICS: tuple[str, ...] = ("dice", "sensitivity", "specificity", "hd95")
METRIC_TITLES = {"dice": "Dice", "sensitivity": "Sensitivity", "specificity": "Specificity", "hd95": "HD95 (mm)"}
# The rule the legacy tables follow, said in one line under each (the official tables follow OFFICIAL_RULE; the
# two score the same predictions differently).
LEGACY_RULE = ("Legacy rules (BraTS 2017-2021, CaPTk): per region over the whole grid, every case in the mean; a "
               "region empty in both maps scores Dice 1 and HD95 0, empty on one side only Dice 0 and HD95 the grid's "
               "diagonal (373.13 mm at 240×240×155, 1 mm).")


def metric_keys(hd95: bool = True, regions: Sequence[str] = REGIONS) -> list[str]:
    """CSV/summary column order: dice_wt, dice_tc, dice_et, sensitivity_wt, ..., hd95_et (for `regions`,
    a run's regions: `brats_swap.model.targets.run_regions`)."""
    names = METRICS if hd95 else METRICS[:-1]
    return [f"{metric}_{region.lower()}" for metric in names for region in regions]


# --------------------------------------------------------------------------------------------------------
# Binary-mask metrics
# --------------------------------------------------------------------------------------------------------


def grid_diagonal_mm(shape: Sequence[int], spacing: Sequence[float]) -> float:
    """Length of the grid's diagonal in mm: the HD95 penalty when exactly one mask is empty."""
    return float(math.sqrt(sum((n * s) ** 2 for n, s in zip(shape, spacing, strict=True))))


def hausdorff95(pred: np.ndarray, truth: np.ndarray, spacing: Sequence[float] = (1.0, 1.0, 1.0)) -> float:
    """95th-percentile symmetric Hausdorff distance in mm between two boolean masks, with the empty rules."""
    import torch
    from monai.metrics import compute_hausdorff_distance

    pred = np.asarray(pred, dtype=bool)
    truth = np.asarray(truth, dtype=bool)
    if pred.shape != truth.shape:
        raise ValueError(f"prediction {pred.shape} and truth {truth.shape} masks differ in shape")
    pred_any, truth_any = bool(pred.any()), bool(truth.any())
    if not pred_any and not truth_any:
        return 0.0
    if pred_any != truth_any:
        return grid_diagonal_mm(pred.shape, spacing)
    with warnings.catch_warnings():
        # MONAI 1.5+ warns about an argument it passes to itself internally; nothing we can change.
        warnings.simplefilter("ignore", FutureWarning)
        distance = compute_hausdorff_distance(
            torch.from_numpy(pred)[None, None], torch.from_numpy(truth)[None, None],
            include_background=True, percentile=95, spacing=[float(s) for s in spacing],
        )
    return float(distance.item())


def _as_numpy(label) -> np.ndarray:
    if isinstance(label, np.ndarray):
        return label
    if hasattr(label, "detach"):  # a torch tensor
        return label.detach().cpu().numpy()
    return np.asarray(label)


def case_metrics(pred_label, true_label, edition: ChallengeSpec | str, spacing: Sequence[float] = (1.0, 1.0, 1.0),
                 hd95: bool = True, regions: Sequence[str] | None = None) -> dict[str, float]:
    """All metrics of one case from two label maps (raw edition label values, same grid, numpy or torch).

    Keys in `metric_keys(hd95, regions)` order: dice_wt, dice_tc, dice_et, sensitivity_wt, ..., hd95_et.
    `regions`: the run's `model.regions` (default: the table's regions, WT/TC/ET for 2017-2021, + RC / CC /
    GTV where the challenge has them). `spacing` is the voxel size in mm along each axis (HD95 only).
    """
    spec = get_challenge(edition)
    names = region_names(spec, regions)
    pred_label = _as_numpy(pred_label)
    true_label = _as_numpy(true_label)
    if pred_label.shape != true_label.shape:
        raise ValueError(f"prediction {pred_label.shape} and truth {true_label.shape} label maps differ in shape")
    if len(spacing) != true_label.ndim:
        raise ValueError(f"spacing {tuple(spacing)} does not match a {true_label.ndim}-D label map")
    pred_regions = {name: isin(pred_label, spec.groups[name]) for name in names}
    true_regions = {name: isin(true_label, spec.groups[name]) for name in names}

    values: dict[str, float] = {}
    for region in names:
        key = region.lower()
        dice, sens, spec_ = dice_sensitivity_specificity(pred_regions[region], true_regions[region])
        values[f"dice_{key}"] = dice
        values[f"sensitivity_{key}"] = sens
        values[f"specificity_{key}"] = spec_
        if hd95:
            values[f"hd95_{key}"] = hausdorff95(pred_regions[region], true_regions[region], spacing)
    return {key: values[key] for key in metric_keys(hd95, names)}


# --------------------------------------------------------------------------------------------------------
# Summaries and reports
# --------------------------------------------------------------------------------------------------------


def _present_keys(rows: Sequence[dict]) -> list[str]:
    present = set().union(*(row.keys() for row in rows)) if rows else set()
    regions = regions_of_columns(key for row in rows for key in row)
    return [key for key in metric_keys(hd95=True, regions=regions) if key in present]


def summarize(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Per metric key: {"mean", "std" (`sample_std`, NaN for one case), "median", "n"} over the cases.

    `rows` are dicts with "case" plus metric keys (as `case_metrics` returns). Non-finite values (a
    metric that could not be computed) are left out of the statistics and of `n`; "infinite" counts the
    infinite ones, which the tables name ("+K inf").
    """
    summary: dict[str, dict[str, float]] = {}
    for key in _present_keys(rows):
        values = np.array([float(row[key]) for row in rows if key in row], dtype=np.float64)
        infinite = int(np.isinf(values).sum())
        values = values[np.isfinite(values)]
        if values.size:
            std = sample_std(values)
            summary[key] = {"mean": float(values.mean()), "std": float("nan") if std is None else std,
                            "median": float(np.median(values)), "n": int(values.size), "infinite": infinite}
        else:
            summary[key] = {"mean": float("nan"), "std": float("nan"), "median": float("nan"), "n": 0,
                            "infinite": infinite}
    return summary


def _format(metric: str, stats: dict[str, float]) -> str:
    digits = 2 if metric == "hd95" else 3
    mean = "—" if math.isnan(stats["mean"]) else f"{stats['mean']:.{digits}f}"
    text = mean if math.isnan(stats["std"]) else f"{mean} ± {stats['std']:.{digits}f}"
    infinite = int(stats.get("infinite") or 0)
    return f"{text} (+{infinite} inf)" if infinite else text


def _table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    regions = regions_of_columns(summary)
    metrics = [m for m in METRICS if any(f"{m}_{r.lower()}" in summary for r in regions)]
    header = ["Region"] + [METRIC_TITLES[m] for m in metrics]
    body = []
    for region in regions:
        cells = [region]
        for metric in metrics:
            stats = summary.get(f"{metric}_{region.lower()}")
            cells.append(_format(metric, stats) if stats else "")
        body.append(cells)
    return header, body


def markdown_table(summary: dict) -> str:
    """A Markdown table, one row per region (WT, TC, ET, ...), one column per metric: mean ± std."""
    header, body = _table_rows(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def print_summary(summary: dict, console, title: str = "") -> None:
    """The same table as `markdown_table`, printed with rich (numbers never cut: `print_results_table`)."""
    header, body = _table_rows(summary)
    n_cases = max((stats["n"] for stats in summary.values()), default=0)
    print_results_table(console, header, body, title=title,
                        caption=f"mean ± std over {n_cases} cases ({STD_NOTE}). {LEGACY_RULE}")


def _metrics_csv(rows: Sequence[dict]) -> str:
    columns = ["case"] + _present_keys(rows)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: row.get(key, "") for key in columns})
    return buffer.getvalue()


def write_metrics_report(rows: Sequence[dict], out_dir: str | Path, title: str = "",
                         official_rows: Sequence[dict] | None = None, groups: Groups | None = None,
                         notes: Sequence[str] = ()) -> dict:
    """Write metrics.csv, summary.json, summary.md and dice_boxplot.png into `out_dir` (each atomically);
    with `official_rows` (per case, `case_official_metrics` columns) and their evaluation `groups`, also
    official.csv and official_summary.json (`write_official_report`) and their table in summary.md.
    `notes`: lines for summary.md's "Cases" section (cases scored as empty, failed, or without reference).

    Returns the summary (`summarize(rows)`), which is also the content of summary.json (a statistic that
    could not be computed, NaN in the returned dict, is null there).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    atomic_write_text(out_dir / "metrics.csv", _metrics_csv(rows))
    atomic_write_json(out_dir / "summary.json", json_safe(summary))
    heading = f"# {title}\n\n" if title else ""
    n_cases = len(rows)
    official = ""
    if official_rows is not None:
        official_summary = write_official_report(official_rows, groups or {}, out_dir)
        official = (f"\n## Official BraTS metrics (lesion-wise, 2023+)\n\n{official_markdown_table(official_summary, groups or {})}"
                    f"\nMeans over cases. {OFFICIAL_RULE}\n")
    cases_section = "\n## Cases\n\n" + "".join(f"- {note}\n" for note in notes) if notes else ""
    atomic_write_text(out_dir / "summary.md",
                      f"{heading}{markdown_table(summary)}\nmean ± std over {n_cases} cases ({STD_NOTE}). {LEGACY_RULE}\n"
                      f"{official}{cases_section}")
    if rows:
        dice_boxplot(rows, out_dir / "dice_boxplot.png", title)
    return summary
