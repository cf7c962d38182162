"""Cross-validation summary: per-fold metrics -> mean ± std over folds, a markdown table, a box plot.

Each evaluated fold has `fold_<k>/metrics.csv` (one row per validation case, columns like `dice_wt`,
`sensitivity_tc`, `hd95_et`). The table follows the paper's Table 2: for each metric and region, the
mean over folds of the per-fold mean, ± the standard deviation over folds (`run.summary_stats.sample_std`,
ddof=1; "—" with a single fold). The box plot shows every validation case of every fold, which is the distribution the
paper's Fig. 5 draws.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.cv.fold_progress import FoldStanding, fold_standing
from brats_swap.data.challenges import REGIONS
from brats_swap.errors import DataError
from brats_swap.evaluate.metrics import LEGACY_RULE
from brats_swap.evaluate.official import (
    OFFICIAL_RULE,
    json_safe,
    merge_groups,
    official_markdown_table,
    read_official_rows,
    read_official_summary,
    summarize_official,
)
from brats_swap.evaluate.postprocessing_rules import KEEP_RULE, load_plan
from brats_swap.run.dice import dice_column, regions_of_columns
from brats_swap.run.figures import dice_boxplot
from brats_swap.run.folder import POSTPROCESSING_FILE, RunFolder
from brats_swap.run.summary_stats import STD_NOTE, sample_std
from brats_swap.timestamps import utc_now

METRICS = ("dice", "sensitivity", "specificity", "hd95")
METRIC_TITLES = {"dice": "Dice", "sensitivity": "Sensitivity", "specificity": "Specificity", "hd95": "HD95 (mm)"}
CASE_COLUMNS = ("case_id", "case", "subject")


def metric_columns(regions: tuple[str, ...] = REGIONS) -> list[str]:
    return [f"{m}_{r.lower()}" for m in METRICS for r in regions]


def _row_regions(rows) -> tuple[str, ...]:
    """The regions the metric rows hold (the run's: `dice_<region>` columns), in column order."""
    return regions_of_columns(key for row in rows for key in row)


def read_case_rows(run_dir: RunFolder | Path, fold: int) -> list[dict]:
    """The fold's per-case metrics as dicts: `case`, `fold`, and a float per metric column present."""
    path = RunFolder.of(run_dir).fold(fold).metrics_csv
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            raw_rows = list(csv.DictReader(handle))
    except OSError as exc:
        raise DataError(f"{path}: cannot read the fold's metrics ({exc.__class__.__name__})") from exc
    rows = []
    columns = metric_columns(_row_regions(raw_rows[:1]))
    for raw in raw_rows:
        case = next((raw[c] for c in CASE_COLUMNS if raw.get(c)), None)
        if case is None:
            continue  # a summary line (e.g. "mean") rather than a case
        row: dict = {"case": case, "fold": fold}
        for column in columns:
            if raw.get(column) not in (None, ""):
                try:
                    row[column] = float(raw[column])
                except ValueError as exc:
                    raise DataError(f"{path}: case {case!r} has {column}={raw[column]!r}, not a number") from exc
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no case rows")
    return rows


def finite_values(values: list[float]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def mean_std(values: list[float]) -> dict:
    """Mean and std of the finite values; "infinite" counts the infinite ones (left out, named in the tables)."""
    finite = finite_values(values)
    infinite = sum(1 for v in values if v is not None and math.isinf(v))
    if not finite:
        return {"mean": None, "std": None, "n": 0, "infinite": infinite}
    return {"mean": statistics.fmean(finite), "std": sample_std(finite), "n": len(finite), "infinite": infinite}


def fold_means(rows: list[dict]) -> dict[str, float | None]:
    """Mean over the fold's cases per metric column (non-finite values, e.g. an undefined HD95, skipped)."""
    out = {}
    for column in metric_columns(_row_regions(rows)):
        finite = finite_values([r[column] for r in rows if column in r])
        out[column] = statistics.fmean(finite) if finite else None
    return out


def aggregate(case_rows_by_fold: dict[int, list[dict]]) -> dict:
    """{metric: {region: {mean, std, n (folds), per_fold: [...], case_mean, case_std, cases}}}."""
    per_fold = {k: fold_means(rows) for k, rows in case_rows_by_fold.items()}
    regions = _row_regions(row for rows in case_rows_by_fold.values() for row in rows)
    table: dict = {}
    for metric in METRICS:
        for region in regions:
            column = f"{metric}_{region.lower()}"
            fold_values = [per_fold[k].get(column) for k in sorted(per_fold)]
            if all(v is None for v in fold_values):
                continue
            over_folds = mean_std([v for v in fold_values if v is not None])
            over_cases = mean_std([r[column] for rows in case_rows_by_fold.values() for r in rows if column in r])
            table.setdefault(metric, {})[region] = {
                **over_folds,
                "per_fold": fold_values,
                "case_mean": over_cases["mean"],
                "case_std": over_cases["std"],
                "cases": over_cases["n"],
                "infinite": over_cases["infinite"],  # cases left out of every mean here, named in the tables
            }
    return table


def format_mean_std(cell: dict | None, digits: int = 3) -> str:
    """"mean ± std", never "inf": infinite values are left out of both and counted ("+K inf")."""
    infinite = int((cell or {}).get("infinite") or 0)
    suffix = f" (+{infinite} inf)" if infinite else ""
    if not cell or cell.get("mean") is None:
        return "—" + suffix
    text = f"{cell['mean']:.{digits}f}"
    return text + (f" ± {cell['std']:.{digits}f}" if cell.get("std") is not None else "") + suffix


def metric_table_rows(table: dict, digits: int = 3) -> tuple[list[str], list[list[str]]]:
    """The header and rows of `aggregate`'s table: one row per metric, one column per region (mean ± std)."""
    regions = list(dict.fromkeys(region for by_region in table.values() for region in by_region))
    rows = [[METRIC_TITLES[metric], *[format_mean_std(table[metric].get(region), 2 if metric == "hd95" else digits)
                                      for region in regions]]
            for metric in METRICS if metric in table]
    return ["metric", *regions], rows


def markdown_metric_table(table: dict, digits: int = 3) -> str:
    header, rows = metric_table_rows(table, digits)
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---|" * (len(header) - 1)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def print_cv_table(run_dir: RunFolder | Path, console) -> bool:
    """The validation table of the run's cv_summary.json on `console`, as cv_summary.md has it (mean ± std over
    the folds done, saying how many of the run's folds those are); False when there is none yet."""
    from brats_swap.evaluate.tables import print_results_table

    run = RunFolder.of(run_dir)
    try:
        summary = json.loads(run.cv_summary_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not summary.get("table"):
        return False
    done, total = len(summary["folds_done"]), len(summary["folds"])
    header, rows = metric_table_rows(summary["table"])
    over = f"{done} fold{'s' if done != 1 else ''}" if summary["complete"] else f"{done} of the run's {total} folds"
    print_results_table(console, header, rows, title=f"{summary['name']}: validation metrics",
                        caption=f"mean ± std over {over} ({STD_NOTE})")
    return True


def fold_record(standing: FoldStanding, rows: list[dict] | None, split_sizes: tuple[int, int]) -> dict:
    state = standing.state
    epoch_seconds = state.epoch_seconds
    return {
        "fold": state.fold,
        "status": standing.label,  # `cv status`'s words: fold_standing decides both
        "train_cases": split_sizes[0],
        "val_cases": split_sizes[1],
        "epochs": state.epochs_completed,
        "best_epoch": state.best_epoch,
        "best_val_dice": state.best_val_dice,
        "stopped_early": state.stopped_early,
        "train_hours": state.train_seconds / 3600.0,
        "median_epoch_seconds": statistics.median(epoch_seconds) if epoch_seconds else None,
        "peak_memory_bytes": state.peak_memory_bytes,
        "invocations": state.invocations,
        "evaluated_at": state.evaluated_at,
        "mean": fold_means(rows) if rows else None,
    }


def _fold_list(folds: list[int]) -> str:
    return ("fold " if len(folds) == 1 else "folds ") + ", ".join(map(str, folds))


def render_cv_markdown(summary: dict, boxplot_link: str, run_dir: Path | str = "RUN") -> str:
    """cv_summary.md; `boxplot_link` is the box plot's path relative to the run folder `run_dir`."""
    done, total = len(summary["folds_done"]), len(summary["folds"])
    regions = summary["regions"]
    not_done = [record["fold"] for record in summary["folds"] if record["fold"] not in summary["folds_done"]]
    lines = [
        f"# Cross-validation: {summary['name']}",
        "",
        f"{done} of {total} folds trained and evaluated"
        + ("." if summary["complete"] else f"; {_fold_list(not_done)} not yet (see the table below): `brats-swap cv "
           f"run --run {run_dir}` continues them, `--folds` names some."),
        f"Summary written {summary['generated_at']}.",
        "",
        f"## Validation metrics, mean ± std over {done} fold{'s' if done != 1 else ''}"
        + ("" if summary["complete"] else f" of {total}"),
        "",
        markdown_metric_table(summary["table"]) if summary["table"] else "No fold evaluated yet.",
        "",
        f"{STD_NOTE}. Per fold: the mean over its cases; the table: the mean over folds of those, ± their std "
        f"(+K inf: K cases with an infinite value, left out). {LEGACY_RULE}",
        "",
        "## Folds",
        "",
        "| fold | status | train/val cases | epochs | best epoch | early stop | hours | s/epoch (median) "
        + "".join(f"| Dice {region} " for region in regions) + "|",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(regions),
    ]
    for record in summary["folds"]:
        mean = record["mean"] or {}
        dice = {r: "—" if mean.get(dice_column(r)) is None else f"{mean[dice_column(r)]:.3f}" for r in regions}

        epoch_s = record["median_epoch_seconds"]
        lines.append(
            f"| {record['fold']} | {record['status'].replace('|', '/')} | {record['train_cases']}/{record['val_cases']} "
            f"| {record['epochs']} | {record['best_epoch'] if record['best_epoch'] is not None else '—'} "
            f"| {'yes' if record['stopped_early'] else 'no'} | {record['train_hours']:.3f} "
            f"| {f'{epoch_s:.1f}' if epoch_s is not None else '—'} | " + " | ".join(dice[r] for r in regions) + " |"
        )
    lines += official_markdown_lines(summary.get("official")) + postprocessing_markdown_lines(summary)
    lines += ["", f"Total training time: {summary['total_train_hours']:.3f} h.", ""]
    if summary["table"]:
        lines += [f"![per-case Dice]({boxplot_link})", ""]
    return "\n".join(lines)


def official_cv_summary(run_dir: RunFolder | Path, folds: list[int]) -> dict | None:
    """The official lesion-wise metrics over every out-of-fold case of these folds (pooled, as the official
    report averages over cases): {"groups", "cases", "summary": `summarize_official`}; None when no fold has
    an official.csv (folds evaluated before the official metrics existed)."""
    run = RunFolder.of(run_dir)
    rows: list[dict] = []
    groups: dict = {}
    for k in folds:
        fold_rows = read_official_rows(run.fold(k).root)
        report = read_official_summary(run.fold(k).root)
        if fold_rows is None or report is None:
            continue
        rows += fold_rows
        groups = merge_groups(groups, report[0])
    if not rows:
        return None
    return {"groups": {name: list(labels) for name, labels in groups.items()}, "cases": len(rows),
            "summary": summarize_official(rows)}


def official_markdown_lines(official: dict | None) -> list[str]:
    """cv_summary.md's section of the official metrics (none without them)."""
    if not official:
        return []
    return [
        "",
        f"## Official BraTS metrics (lesion-wise), over the {official['cases']} out-of-fold cases",
        "",
        official_markdown_table(official["summary"], official["groups"]).rstrip("\n"),
        "",
        f"Means over cases. {OFFICIAL_RULE}",
    ]


def postprocessing_record(run_dir: RunFolder | Path) -> dict | None:
    """The run's postprocessing.json (`PostprocessingPlan.to_dict()` plus "description"), None if absent."""
    run = RunFolder.of(run_dir)
    if not run.postprocessing.is_file():
        return None
    plan = load_plan(run.postprocessing)
    return {**plan.to_dict(), "description": plan.describe()}


def postprocessing_markdown_lines(summary: dict) -> list[str]:
    """cv_summary.md's postprocessing section: why nothing was tuned, or per rule (and group) the best
    value, the cases it changes, before/after and whether it was kept; then the per-group Dice before/after."""
    plan = summary.get("postprocessing")
    if plan is None:
        why = summary.get("postprocessing_not_tuned")
        return ["", "## Postprocessing", "", f"Not tuned: {why}."] if why else []
    if plan.get("not_tuned"):
        return ["", f"## Postprocessing, not tuned on the {plan['n_cases']} out-of-fold predictions", "",
                f"No postprocessing: {plan['not_tuned']} (`{POSTPROCESSING_FILE}` holds the identity plan; "
                f"`brats-swap predict` applies nothing)."]
    lines = [
        "",
        f"## Postprocessing, tuned on the {plan['n_cases']} out-of-fold predictions",
        "",
        f"Chosen: {plan['description']} (`{POSTPROCESSING_FILE}`, applied by `brats-swap predict`).",
        f"Keep rule: {KEEP_RULE.describe()}.",
    ]
    if plan.get("rules"):
        lines += ["", "| rule | group | value kept | best value | cases changed | improved / worsened "
                  "| mean lesion-wise Dice before | with the best value | outcome |",
                  "|---|---|---:|---:|---|---:|---:|---:|---|"]
        for rule in plan["rules"]:
            changed = rule["changed_cases"]
            shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
            lines.append(f"| {rule['rule']} | {rule['group'] or '—'} | {rule['value']} | {rule['candidate']} "
                         f"| {len(changed)}{f': {shown}' if changed else ''} | {rule['improved']} / {rule['worsened']} "
                         f"| {rule['before']:.4f} | {rule['after']:.4f} | {rule['why']} |")
    lines += ["", "| group | minimum component (voxels) | lesion-wise Dice before | after |", "|---|---:|---:|---:|"]
    for name in plan["groups"]:
        before, after = plan["lesionwise_dice_before"].get(name), plan["lesionwise_dice_after"].get(name)
        lines.append(f"| {name} | {plan['min_component_voxels'].get(name, 0)} "
                     f"| {'—' if before is None else f'{before:.4f}'} | {'—' if after is None else f'{after:.4f}'} |")
    lines += ["", "Lesion-wise Dice: the official per-case mean over matched lesions, averaged over the cases; here a "
              "case without a lesion of the group on either side counts 1 (a correct empty prediction)."]
    return lines


def build_cv_summary(name: str, run_dir: RunFolder | Path, splits: dict,
                     postprocessing_not_tuned: str | None = None) -> tuple[dict, dict[int, list[dict]]]:
    """The summary of every fold of the run (splits.json's; the all-cases model is never one: its "validation"
    cases are its training cases), each in the stage `fold_standing` gives it; "complete" only when every one is
    done. `postprocessing_not_tuned` is why there is no postprocessing.json (`tune_after_cv`'s reason)."""
    folds = list(range(len(splits["folds"])))
    standings = {k: fold_standing(run_dir, k) for k in folds}
    states = {k: standings[k].state for k in folds}
    rows_by_fold = {k: read_case_rows(run_dir, k) for k in folds if states[k].evaluated}
    records = []
    for k in folds:
        entry = splits["folds"][k]
        records.append(fold_record(standings[k], rows_by_fold.get(k), (len(entry["train"]), len(entry["val"]))))
    summary = {
        "name": name,
        "generated_at": utc_now(),
        "complete": all(states[k].done for k in folds),
        "folds_done": [k for k in folds if states[k].done],
        "folds": records,
        "total_train_hours": sum(states[k].train_seconds for k in folds) / 3600.0,
        # The run's regions: those its folds were scored (else validated) on; WT/TC/ET before either.
        "regions": list(_row_regions(row for rows in rows_by_fold.values() for row in rows)
                        or _row_regions(record for k in folds for record in states[k].history) or REGIONS),
        "table": aggregate(rows_by_fold) if rows_by_fold else {},
        "official": official_cv_summary(run_dir, sorted(rows_by_fold)),
        "postprocessing": postprocessing_record(run_dir),
        "postprocessing_not_tuned": postprocessing_not_tuned,
    }
    return summary, rows_by_fold


def write_cv_summary(name: str, run_dir: RunFolder | Path, splits: dict,
                     postprocessing_not_tuned: str | None = None) -> dict:
    """Write cv_summary.json, cv_summary.md and figures/dice_boxplot.png (atomically) of every fold of the run
    (`build_cv_summary`); return the summary."""
    run = RunFolder.of(run_dir)
    summary, rows_by_fold = build_cv_summary(name, run, splits, postprocessing_not_tuned)
    atomic_write_json(run.cv_summary_json, json_safe(summary))  # NaN -> null, inf -> "inf"
    atomic_write_text(run.cv_summary_md, render_cv_markdown(summary, run.relative(run.cv_boxplot), run.root))
    all_rows = [r for k in sorted(rows_by_fold) for r in rows_by_fold[k]]
    if all_rows:
        dice_boxplot(all_rows, run.cv_boxplot, f"{name}: per-case Dice, {len(rows_by_fold)} fold(s)")
    return summary
