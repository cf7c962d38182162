"""The official BraTS 2023+ lesion-wise metrics, computed with panoptica exactly as the BraTS evaluation
package (`brats-evaluation`, the challenges' own scorer) configures it.

Per evaluation group of a challenge (GLI: ET [3], NETC [1], SNFH [2], RC [4], TC [1,3], WT [1,2,3]; PED:
ET [1], NETC [2], CC [3], ED [4], TC [1,2,3], WT [1,2,3,4]; ...), the official configuration is:

- a group of one label keeps that label, a group of several labels is merged into one binary mask;
- lesions are the 26-connected components of the group's mask, in prediction and reference alike;
- predicted and reference lesions are paired by maximal bipartite matching on their Dice (Hungarian
  algorithm); a pair counts only if its Dice exceeds 1e-6, i.e. if the lesions overlap;
- per case and group it reports TP / FP / FN (matched, unmatched predicted, unmatched reference lesions),
  precision, recall and F1 = TP / (TP + (FP + FN) / 2); the lesion-wise Dice, NSD and HD95 are the mean
  (and std) over the matched pairs only, so an unmatched lesion costs F1, not lesion-wise Dice;
- with no matched pair: lesion-wise Dice and NSD are 0 and lesion-wise HD95 is infinite when either side
  has lesions (the official report leaves that infinity as it is); with no lesion on either side every
  metric is NaN and the official mean over cases leaves that case out;
- the global Dice, NSD and HD95 compare the group's whole masks; when they do not overlap, Dice and NSD
  are 0 and HD95 is 373 (the diagonal of the 240x240x155 SRI grid in mm, the official penalty);
- panoptica computes the global metrics without the voxel spacing: the global HD95 is in voxels and the
  global NSD counts surface points within 0.5 voxel; the lesion-wise NSD tolerance is the smallest voxel
  spacing and the lesion-wise HD95 is in mm. On BraTS data (1 mm isotropic) voxels and mm coincide.

Columns are the official report's, per group `g` (lower-case): all_instance_tp/fp/fn/prec/rec/f1_g,
global_dsc/nsd/hd95_g, lesionwise_dsc/nsd/hd95_mean_g and lesionwise_dsc/nsd/hd95_std_g.

panoptica (Apache-2.0) does the instance approximation, matching and metrics; please cite it when you
report these numbers: Kofler, Möller et al., "Panoptica -- instance-wise evaluation of 3D semantic and
instance segmentation maps", https://github.com/BrainLesion/panoptica#citation.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.errors import DataError
from brats_swap.run.folder import OFFICIAL_CSV, OFFICIAL_SUMMARY_JSON
from brats_swap.run.summary_stats import sample_std

# Diameter of the SRI-24 atlas grid (240x240x155 at 1 mm) in mm: the official report writes this instead
# of an infinite global HD95.
HD95_PENALTY_MM = 373.0

# (column stem, key in panoptica's result), in the official report's column order.
_RESULT_KEYS: tuple[tuple[str, str], ...] = (
    ("all_instance_tp", "tp"),
    ("all_instance_fp", "fp"),
    ("all_instance_fn", "fn"),
    ("all_instance_prec", "prec"),
    ("all_instance_rec", "rec"),
    ("all_instance_f1", "rq"),
    ("global_dsc", "global_bin_dsc"),
    ("global_nsd", "global_bin_nsd"),
    ("global_hd95", "global_bin_hd95"),
    ("lesionwise_dsc_mean", "sq_dsc"),
    ("lesionwise_dsc_std", "sq_dsc_std"),
    ("lesionwise_nsd_mean", "sq_nsd"),
    ("lesionwise_nsd_std", "sq_nsd_std"),
    ("lesionwise_hd95_mean", "sq_hd95"),
    ("lesionwise_hd95_std", "sq_hd95_std"),
)
OFFICIAL_METRICS: tuple[str, ...] = tuple(stem for stem, _ in _RESULT_KEYS)
COUNT_METRICS: tuple[str, ...] = ("all_instance_tp", "all_instance_fp", "all_instance_fn")

Groups = Mapping[str, Sequence[int]]


def official_columns(groups: Groups) -> list[str]:
    """Every official column for these groups: the 15 metrics of the first group, then the next group's."""
    return [f"{stem}_{name.lower()}" for name in groups for stem in OFFICIAL_METRICS]


def _group_key(groups: Groups) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((str(name), tuple(int(label) for label in labels)) for name, labels in groups.items())


@lru_cache(maxsize=16)
def _evaluator(group_key: tuple[tuple[str, tuple[int, ...]], ...], metrics: tuple[str, ...]):
    """A panoptica evaluator configured as the official BraTS configs (only the groups differ per challenge).

    `metrics` are panoptica metric names, used both per lesion and globally: ("DSC", "NSD", "HD95") is the
    official set; the postprocessing tuner asks for ("DSC",) alone, which gives the same Dice faster.
    """
    from panoptica import (
        ConnectedComponentsInstanceApproximator,
        InputType,
        MaxBipartiteMatching,
        Metric,
        Panoptica_Evaluator,
        disable_citation_reminder,
    )
    from panoptica.utils.edge_case_handling import (
        EdgeCaseHandler,
        EdgeCaseResult,
        MetricZeroTPEdgeCaseHandling,
    )
    from panoptica.utils.label_group import LabelGroup, LabelMergeGroup
    from panoptica.utils.segmentation_class import SegmentationClassGroups

    # The citation is in this module's docstring; panoptica's banner would break our progress bars.
    disable_citation_reminder()
    # Without a matched pair but with lesions on some side: Dice and NSD 0, HD95 infinite.
    zero_tp = {"DSC": EdgeCaseResult.ZERO, "NSD": EdgeCaseResult.ZERO, "HD95": EdgeCaseResult.INF}
    edge_cases = EdgeCaseHandler(
        listmetric_zeroTP_handling={
            Metric[name]: MetricZeroTPEdgeCaseHandling(
                no_instances_result=EdgeCaseResult.NAN, empty_prediction_result=zero_tp[name],
                empty_reference_result=zero_tp[name], normal=zero_tp[name])
            for name in ("DSC", "NSD", "HD95")
        },
        empty_list_std=EdgeCaseResult.NAN,
    )
    label_groups = {
        name: (LabelGroup(list(labels)) if len(labels) == 1 else LabelMergeGroup(list(labels)))
        for name, labels in group_key
    }
    # Overlapping groups (TC inside WT) are intended; panoptica prints a question about them.
    with contextlib.redirect_stdout(io.StringIO()):
        class_groups = SegmentationClassGroups(label_groups)
    chosen = [Metric[name] for name in metrics]
    return Panoptica_Evaluator(
        expected_input=InputType.SEMANTIC,
        instance_approximator=ConnectedComponentsInstanceApproximator(cca_backend=None),
        instance_matcher=MaxBipartiteMatching(matching_metric=Metric.DSC, matching_threshold=1e-6),
        edge_case_handler=edge_cases,
        segmentation_class_groups=class_groups,
        instance_metrics=chosen,
        global_metrics=chosen,
        decision_metric=None,
        decision_threshold=None,
        log_times=False,
        verbose=False,
    )


def official_evaluator(groups: Groups):
    """The panoptica `Panoptica_Evaluator` with the official BraTS configuration for these groups."""
    return _evaluator(_group_key(groups), ("DSC", "NSD", "HD95"))


def check_labels(labels: np.ndarray, groups: Groups, what: str) -> None:
    """DataError (one line, starting with `what`) if `labels` has a value that no group contains."""
    known = {int(label) for member in groups.values() for label in member}
    found = {int(value) for value in np.unique(labels)} - {0}
    unknown = sorted(found - known)
    if unknown:
        raise DataError(f"{what}: labels {unknown} are in no evaluation group "
                        f"({', '.join(f'{n} {list(v)}' for n, v in groups.items())})")


def _float(value) -> float:
    return float("nan") if value is None else float(value)


def _row_from_result(name: str, result: dict) -> dict[str, float | int]:
    # The same reading of panoptica's result as the official report parser: missing -> NaN, and only the
    # global HD95 has its infinity replaced by the 373 mm penalty.
    row: dict[str, float | int] = {}
    for stem, key in _RESULT_KEYS:
        value = _float(result.get(key))
        if stem == "global_hd95" and math.isinf(value):
            value = HD95_PENALTY_MM
        if stem in COUNT_METRICS and math.isfinite(value):
            value = int(value)
        row[f"{stem}_{name.lower()}"] = value
    return row


def _oriented(labels: np.ndarray) -> np.ndarray:
    # The official package reads NIfTI files with SimpleITK, which returns the voxels in (z, y, x) order;
    # evaluating the same view numbers the lesions in the same order, so even ties in the matching are
    # broken as the official scorer breaks them. The spacing is reversed with it.
    return np.ascontiguousarray(labels.transpose(tuple(reversed(range(labels.ndim)))))


def evaluate_groups(pred_label: np.ndarray, true_label: np.ndarray, groups: Groups,
                    spacing: Sequence[float] = (1.0, 1.0, 1.0), metrics: tuple[str, ...] = ("DSC", "NSD", "HD95"),
                    only: Sequence[str] | None = None, what: str = "case") -> dict[str, dict]:
    """panoptica's raw result per group name (the `to_dict()` of each `PanopticaResult`).

    `only` limits the evaluation to these group names. `what` starts error messages (e.g. "case X").
    """
    pred_label = np.asarray(pred_label)
    true_label = np.asarray(true_label)
    if pred_label.shape != true_label.shape:
        raise DataError(f"{what}: prediction {pred_label.shape} and reference {true_label.shape} differ in shape")
    if len(spacing) != true_label.ndim:
        raise DataError(f"{what}: spacing {tuple(spacing)} does not match a {true_label.ndim}-D label map")
    check_labels(pred_label, groups, f"{what}: prediction")
    check_labels(true_label, groups, f"{what}: reference")
    evaluator = _evaluator(_group_key(groups), tuple(metrics))
    skip = None if only is None else [n.lower() for n in groups if n not in set(only)]
    with warnings.catch_warnings():
        # panoptica warns that the global NSD uses its 0.5-voxel default tolerance: that is the official setup.
        warnings.simplefilter("ignore", UserWarning)
        results = evaluator.evaluate(
            _oriented(pred_label.astype(np.uint8, copy=False)), _oriented(true_label.astype(np.uint8, copy=False)),
            voxelspacing=tuple(float(s) for s in reversed(spacing)), skip_groups=skip, verbose=False)
    by_lower = {name.lower(): name for name in groups}
    return {by_lower[key]: result.to_dict() for key, result in results.items()}


def case_official_metrics(pred_label: np.ndarray, true_label: np.ndarray, groups: Groups,
                          spacing: Sequence[float] = (1.0, 1.0, 1.0), what: str = "case",
                          hd95: bool = True) -> dict[str, float | int]:
    """The official columns of one case (`official_columns(groups)` order) from two label maps.

    `pred_label`, `true_label`: the challenge's label values on the same grid (numpy, same shape).
    `spacing`: voxel size in mm along each array axis. `groups`: name -> label values, e.g.
    {"ET": (3,), "NETC": (1,), "SNFH": (2,), "RC": (4,), "TC": (1, 3), "WT": (1, 2, 3)}.
    TP/FP/FN are ints; the other values are floats: NaN where undefined (no lesion on either side;
    precision without predicted lesions, recall without reference lesions), inf for the lesion-wise HD95
    of a group with lesions but no matched pair. `hd95=False` (`evaluate.hd95: false`, HD95 is the slow
    metric): the HD95 columns are NaN, not computed, and the tables leave them out.
    """
    metrics = ("DSC", "NSD", "HD95") if hd95 else ("DSC", "NSD")
    results = evaluate_groups(pred_label, true_label, groups, spacing, metrics=metrics, what=what)
    row: dict[str, float | int] = {}
    for name in groups:
        row.update(_row_from_result(name, results[name]))
    return row


def summarize_official(rows: Sequence[Mapping]) -> dict[str, dict[str, float]]:
    """Per official column present in `rows`: {"mean", "std", "median", "n"} over the cases, plus "total"
    for the TP/FP/FN counts.

    The same statistics as the official report's summary rows: NaN values (no lesion on either side) are
    left out, an infinite lesion-wise HD95 makes the mean infinite, std is `sample_std` (ddof 1). Beside them,
    "infinite" counts the infinite values and "finite_mean" is the mean of the others, which the tables show
    (`official_cell`) instead of an infinite mean.
    """
    summary: dict[str, dict[str, float]] = {}
    columns = [key for key in (rows[0] if rows else {}) if any(key.startswith(stem + "_") for stem in OFFICIAL_METRICS)]
    for key in columns:
        values = np.array([float(row[key]) for row in rows if key in row], dtype=np.float64)
        values = values[~np.isnan(values)]
        stats = {"mean": float("nan"), "std": float("nan"), "median": float("nan"), "n": int(values.size)}
        finite = values[np.isfinite(values)]
        stats["infinite"] = int(values.size - finite.size)
        stats["finite_mean"] = float(finite.mean()) if finite.size else float("nan")
        if values.size:
            with np.errstate(invalid="ignore"):
                stats["mean"] = float(values.mean())
                stats["median"] = float(np.median(values))
                std = sample_std(values)
                stats["std"] = float("nan") if std is None else std
        if any(key.startswith(stem + "_") for stem in COUNT_METRICS):
            stats["total"] = float(values.sum())
        summary[key] = stats
    return summary


# Table columns: (title, column stem, digits).
TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("Dice", "global_dsc", 3),
    ("NSD", "global_nsd", 3),
    ("HD95", "global_hd95", 2),
    ("Lesion Dice", "lesionwise_dsc_mean", 3),
    ("Lesion NSD", "lesionwise_nsd_mean", 3),
    ("Lesion HD95", "lesionwise_hd95_mean", 2),
    ("F1", "all_instance_f1", 3),
)


def official_table_rows(summary: Mapping[str, Mapping[str, float]], groups: Groups) -> tuple[list[str], list[list[str]]]:
    """Header and one row per group: the means of the ranking metrics and the total TP / FP / FN."""
    columns = [column for column in TABLE_COLUMNS if "hd95" not in column[1] or any(
        summary.get(f"{column[1]}_{name.lower()}", {}).get("n") for name in groups)]  # HD95 not computed: left out
    header = ["Group"] + [title for title, _, _ in columns] + ["TP", "FP", "FN"]
    body = []
    for name in groups:
        cells = [name]
        for _, stem, digits in columns:
            cells.append(official_cell(summary.get(f"{stem}_{name.lower()}"), digits))
        for stem in COUNT_METRICS:
            stats = summary.get(f"{stem}_{name.lower()}")
            cells.append(f"{int(stats['total'])}" if stats else "—")
        body.append(cells)
    return header, body


def official_cell(stats: Mapping[str, float] | None, digits: int) -> str:
    """A table cell of a mean over cases (`summarize_official`'s statistics), never "inf": where K cases are
    infinite (lesions but no matched pair: an infinite lesion-wise HD95) the mean of the others and "(+K inf)";
    "—" where no case has a lesion of the group. A summary written before the count was kept says "some"."""
    if not stats or not stats.get("n"):
        return "—"
    mean, infinite = stats.get("mean"), int(stats.get("infinite") or 0)
    if not infinite:
        if mean is not None and math.isinf(mean):
            return "— (some cases inf)"
        return "—" if mean is None or math.isnan(mean) else f"{mean:.{digits}f}"
    finite = stats.get("finite_mean")
    shown = "—" if finite is None or math.isnan(finite) else f"{finite:.{digits}f}"
    return f"{shown} (+{infinite} inf)"


# The rule each table follows, said in one line under it: the legacy (evaluate/metrics.py) and the official
# rules score the same predictions differently (an empty prediction, HD95's penalty, what a mean leaves out).
OFFICIAL_RULE = ("Official rules (BraTS 2023+, panoptica): per lesion over matched pairs, a case without a lesion of "
                 "the group on either side left out of the mean; no matched pair: lesion Dice 0 and lesion HD95 "
                 "infinite (+K inf: K such cases, left out of the mean shown); global HD95 373 when the masks do not "
                 "overlap; TP / FP / FN summed over cases.")


def official_markdown_table(summary: Mapping[str, Mapping[str, float]], groups: Groups) -> str:
    """A Markdown table of `official_table_rows` (means over cases; lesion-free cases left out)."""
    header, body = official_table_rows(summary, groups)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def print_official_summary(summary: Mapping[str, Mapping[str, float]], groups: Groups, console, title: str = "") -> None:
    """The same table as `official_markdown_table`, printed with rich (numbers never cut)."""
    from brats_swap.evaluate.tables import print_results_table

    header, body = official_table_rows(summary, groups)
    print_results_table(console, header, body, title=title, caption=f"mean over cases. {OFFICIAL_RULE}")


# ---- the report files ---------------------------------------------------------------------------------------
# JSON has no NaN or infinity: `json_safe` writes NaN as null and ±infinity as the strings "inf" / "-inf";
# `from_json` reads them back. The CSV files write them as Python does ("nan", "inf"), which float() reads.


def json_safe(value):
    """`value` (nested dicts, lists, numbers) with NaN -> None and ±inf -> "inf"/"-inf", for valid JSON."""
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value


def from_json(value):
    """The inverse of `json_safe` for a summary's statistics: None -> NaN, "inf"/"-inf" -> ±infinity."""
    if isinstance(value, Mapping):
        return {key: from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if value is None:
        return float("nan")
    if value in ("inf", "-inf"):
        return float(value)
    return value


def merge_groups(*groups: Groups) -> dict[str, tuple[int, ...]]:
    """The groups of several challenges in first-seen order (a name keeps its first labels): the table
    rows of a report over cases of several challenges."""
    merged: dict[str, tuple[int, ...]] = {}
    for member in groups:
        for name, labels in member.items():
            merged.setdefault(str(name), tuple(int(label) for label in labels))
    return merged


def official_csv_text(rows: Sequence[Mapping]) -> str:
    """`case` then every official column present in `rows`, one line per case (missing cells empty)."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.update((key, None) for key in row if key != "case")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["case", *seen], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: row.get(key, "") for key in ["case", *seen]})
    return buffer.getvalue()


def write_official_report(rows: Sequence[Mapping], groups: Groups, out_dir: str | Path) -> dict:
    """Write `official.csv` (one row per case) and `official_summary.json` ({"groups", "cases", "summary":
    `summarize_official(rows)`}, JSON-safe) into `out_dir`, atomically; return the summary (floats)."""
    out_dir = Path(out_dir)
    summary = summarize_official(rows)
    atomic_write_text(out_dir / OFFICIAL_CSV, official_csv_text(rows))
    atomic_write_json(out_dir / OFFICIAL_SUMMARY_JSON, json_safe(
        {"groups": {name: list(labels) for name, labels in groups.items()}, "cases": len(rows), "summary": summary}))
    return summary


def read_official_summary(folder: str | Path) -> tuple[dict[str, tuple[int, ...]], dict] | None:
    """(groups, summary) of the `official_summary.json` in `folder`, None when there is none; DataError
    naming the file when it is unreadable."""
    path = Path(folder) / OFFICIAL_SUMMARY_JSON
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        groups = {str(name): tuple(int(v) for v in labels) for name, labels in data["groups"].items()}
        return groups, from_json(data["summary"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise DataError(f"{path}: unreadable official summary ({exc.__class__.__name__}: {exc})") from None


def read_official_rows(folder: str | Path) -> list[dict] | None:
    """The per-case rows of the `official.csv` in `folder` (numbers as floats, counts as ints), None when
    there is none; DataError naming the file and cell when a value is not a number."""
    path = Path(folder) / OFFICIAL_CSV
    if not path.is_file():
        return None
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            raw_rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the official metrics ({exc.__class__.__name__})") from None
    rows = []
    for raw in raw_rows:
        row: dict = {"case": raw.get("case", "")}
        for key, text in raw.items():
            if key == "case" or text in (None, ""):
                continue
            try:
                value = float(text)
            except ValueError:
                raise DataError(f"{path}: case {row['case']!r} has {key}={text!r}, not a number") from None
            counted = any(key.startswith(stem + "_") for stem in COUNT_METRICS) and math.isfinite(value)
            row[key] = int(value) if counted else value
        rows.append(row)
    return rows
