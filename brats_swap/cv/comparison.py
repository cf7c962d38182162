"""The numbers of `compare --patch`: paired per-case metrics of the two arms, timing, compare.json/.md.

Only validation cases evaluated in both arms are compared (same cases, same order), so every difference
is a paired one; the Wilcoxon signed-rank test is the paired test the paper's comparison calls for.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config import Config
from brats_swap.cv.compare_figures import overlay_figure, paired_boxplot, training_curves
from brats_swap.cv.fold_progress import FoldState, read_fold_state
from brats_swap.cv.summary import METRIC_TITLES, METRICS, format_mean_std, mean_std, read_case_rows
from brats_swap.evaluate.official import (
    OFFICIAL_RULE,
    json_safe,
    merge_groups,
    official_cell,
    read_official_rows,
    read_official_summary,
    summarize_official,
)
from brats_swap.run.dice import dice_column, regions_of_columns
from brats_swap.run.folder import COMPARE_ARMS, RunFolder
from brats_swap.run.summary_stats import STD_NOTE
from brats_swap.timestamps import utc_now


def _paired_rows(run: RunFolder, folds: list[int]) -> dict[str, list[dict]]:
    """Per-case metric rows of the folds evaluated in both arms (same cases, same order)."""
    rows: dict[str, list[dict]] = {arm: [] for arm in COMPARE_ARMS}
    for k in folds:
        states = {arm: read_fold_state(run.arm(arm), k) for arm in COMPARE_ARMS}
        if not all(s.evaluated for s in states.values()):
            continue
        by_case = {arm: {r["case"]: r for r in read_case_rows(run.arm(arm), k)} for arm in COMPARE_ARMS}
        for case in sorted(set(by_case["full"]) & set(by_case["patch"])):
            for arm in COMPARE_ARMS:
                rows[arm].append(by_case[arm][case])
    return rows


def _wilcoxon_p(differences: list[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value of the paired differences (None when undefined)."""
    nonzero = [d for d in differences if math.isfinite(d) and d != 0.0]
    if len(nonzero) < 2:
        return None
    from scipy.stats import wilcoxon

    try:
        return float(wilcoxon(nonzero).pvalue)
    except ValueError:
        return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _arm_timing(arm: RunFolder, folds: list[int]) -> dict:
    """The arm's training cost over these folds, from each epoch's record: a training step, an epoch's training
    (its steps and their wait for data) and a validation apart, since validation does not scale with the
    steps of an epoch and runs only every `train.val_every` epochs."""
    states: list[FoldState] = [read_fold_state(arm, k) for k in folds]
    epoch_seconds = [s for state in states for s in state.epoch_seconds]
    records = [record for state in states for record in state.history]
    validations = [float(record["val_seconds"]) for record in records if "val_seconds" in record]
    return {
        "median_epoch_seconds": _median(epoch_seconds),  # training and, where it ran, validation
        "median_step_seconds": _median([float(r["step_s"]) for r in records if "step_s" in r]),
        "median_epoch_training_seconds": _median([float(r["epoch_s"]) - float(r.get("val_seconds", 0.0))
                                                  for r in records if "epoch_s" in r]),
        "median_validation_seconds": _median(validations),
        "validations": len(validations),
        "total_train_hours": sum(state.train_seconds for state in states) / 3600.0,
        "epochs_per_fold": [state.epochs_completed for state in states],
        "best_epoch_per_fold": [state.best_epoch for state in states],
        "stopped_early_per_fold": [state.stopped_early for state in states],
        "peak_memory_bytes": max((state.peak_memory_bytes for state in states), default=0),
        "folds_done": [state.fold for state in states if state.done],
        "device": _run_device(arm),
    }


def _run_device(arm: RunFolder) -> str | None:
    """The device the arm trained on, from the env.json the training loop writes into the run folder."""
    try:
        return json.loads(arm.env.read_text(encoding="utf-8")).get("device")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _metric_cell(metric: str, values: dict[str, list[float]]) -> dict:
    """Both arms' statistics of one metric column and their paired difference (whole − patch)."""
    differences = [a - b for a, b in zip(values["full"], values["patch"], strict=True)]
    finite_differences = [d for d in differences if math.isfinite(d)]
    # HD95 is a distance: the whole-volume model is better on a case when its HD95 is lower.
    better = [d < 0 if metric == "hd95" else d > 0 for d in finite_differences]
    return {
        "full": mean_std(values["full"]),
        "patch": mean_std(values["patch"]),
        "difference": statistics.fmean(finite_differences) if finite_differences else None,
        "full_better_cases": sum(better),
        "wilcoxon_p": _wilcoxon_p(differences),
    }


def build_comparison(run_dir: RunFolder | Path, folds: list[int]) -> dict:
    run = RunFolder.of(run_dir)
    rows = _paired_rows(run, folds)
    cases = len(rows["full"])
    regions = regions_of_columns(key for row in rows["full"] for key in row)  # the run's regions, as scored
    metrics: dict = {}
    for metric in METRICS:
        for region in regions:
            column = f"{metric}_{region.lower()}"
            if not all(column in r for arm in COMPARE_ARMS for r in rows[arm]) or not cases:
                continue
            values = {arm: [r[column] for r in rows[arm]] for arm in COMPARE_ARMS}
            metrics.setdefault(metric, {})[region] = _metric_cell(metric, values)
    return {
        "generated_at": utc_now(),
        "folds": folds,
        "folds_compared": sorted({r["fold"] for r in rows["full"]}),
        "paired_cases": cases,
        "regions": list(regions),
        "metrics": metrics,
        "official": _official_comparison(run, rows),
        "timing": {arm: _arm_timing(run.arm(arm), folds) for arm in COMPARE_ARMS},
        "cases": [
            {"case": f["case"], "fold": f["fold"],
             **{f"{arm}_{dice_column(r)}": row.get(dice_column(r)) for arm, row in (("full", f), ("patch", p))
                for r in regions}}
            for f, p in zip(rows["full"], rows["patch"], strict=True)
        ],
    }


# The official columns compare.md shows per group: (title, column stem, digits).
_OFFICIAL_COMPARED = (("Lesion-wise Dice", "lesionwise_dsc_mean", 3), ("Lesion-wise HD95 (mm)", "lesionwise_hd95_mean", 2),
                      ("Lesion F1", "all_instance_f1", 3), ("Dice", "global_dsc", 3))


def _official_comparison(run: RunFolder, rows: dict[str, list[dict]]) -> dict | None:
    """Both arms' official summaries over the paired cases ({"groups", "full", "patch"}); None when a
    compared fold has no official.csv."""
    paired = {(row["fold"], row["case"]) for row in rows["full"]}
    if not paired:
        return None
    summaries: dict = {}
    groups: dict = {}
    for arm in COMPARE_ARMS:
        arm_rows = []
        for k in sorted({fold for fold, _ in paired}):
            folder = run.arm(arm).fold(k).root
            fold_rows, report = read_official_rows(folder), read_official_summary(folder)
            if fold_rows is None or report is None:
                return None
            arm_rows += [row for row in fold_rows if (k, row["case"]) in paired]
            groups = merge_groups(groups, report[0])
        summaries[arm] = summarize_official(arm_rows)
    return {"groups": {name: list(labels) for name, labels in groups.items()}, **summaries}


def _official_table(official: dict | None) -> list[str]:
    """compare.md's official section: per group, the mean of each compared column in both arms."""
    if not official:
        return []
    lines = ["## Official BraTS metrics (lesion-wise; mean over the paired cases)", "",
             "| group | metric | whole volume | patches | difference (whole − patch) |", "|---|---|---|---|---|"]
    for group in official["groups"]:
        for title, stem, digits in _OFFICIAL_COMPARED:
            stats = {arm: official[arm].get(f"{stem}_{group.lower()}", {}) for arm in COMPARE_ARMS}
            means = [stats[arm].get("mean") for arm in COMPARE_ARMS]
            finite = all(value is not None and math.isfinite(value) for value in means)
            difference = means[0] - means[1] if finite else None  # none where a case is infinite
            lines.append(f"| {group} | {title} | {official_cell(stats['full'], digits)} "
                         f"| {official_cell(stats['patch'], digits)} | {_fmt(difference, digits, signed=True)} |")
    return [*lines, "", OFFICIAL_RULE, ""]


def _fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "—"
    if abs(value) < 0.5 * 10**-digits:
        value = 0.0  # no "-0.000"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _gib(n_bytes: int | None) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes else "—"


def _cpu_memory_note(comparison: dict) -> list[str]:
    if not any(str(comparison["timing"][arm].get("device", "")).startswith("cpu") for arm in COMPARE_ARMS):
        return []
    return ["On CPU the training loop reports the process's peak resident memory, which only grows: when both arms "
            "train in one process, the second arm's figure includes the first's, so it does not compare them.", ""]


def metric_table_rows(comparison: dict) -> tuple[list[str], list[list[str]]]:
    """The header and rows of compare.md's validation table, which `compare` also prints."""
    header = ["metric", "region", "whole volume", "patches", "difference (whole − patch)", "whole better", "Wilcoxon p"]
    rows = []
    for metric, by_region in comparison["metrics"].items():
        digits = 2 if metric == "hd95" else 3
        for region, cell in by_region.items():
            rows.append([METRIC_TITLES[metric], region, format_mean_std(cell["full"], digits),
                         format_mean_std(cell["patch"], digits), _fmt(cell["difference"], digits, signed=True),
                         f"{cell['full_better_cases']}/{cell['full']['n']}", _fmt(cell["wilcoxon_p"], 3)])
    return header, rows


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(cells) + " |" for cells in rows]]


def _metric_table(comparison: dict) -> list[str]:
    return _markdown(*metric_table_rows(comparison))


def cost_table_rows(timing: dict) -> tuple[list[str], list[list[str]]]:
    """The header and rows of compare.md's training cost table, which `compare` also prints."""
    def row(title: str, cell) -> list[str]:
        return [title, *(cell(timing[arm]) for arm in COMPARE_ARMS)]

    return ["", "whole volume", "patches"], [
        row("training step (median, s)", lambda t: _fmt(t.get("median_step_seconds"), 2)),
        row("epoch without validation (median, s)", lambda t: _fmt(t.get("median_epoch_training_seconds"), 1)),
        row("validation (median, s)", lambda t: f"{_fmt(t.get('median_validation_seconds'), 1)} "
            f"({t.get('validations', 0)} run{'s' if t.get('validations', 0) != 1 else ''})"),
        row("total training (h)", lambda t: _fmt(t["total_train_hours"], 3)),
        row("epochs per fold", lambda t: ", ".join(map(str, t["epochs_per_fold"]))),
        row("best epoch per fold", lambda t: ", ".join("—" if e is None else str(e) for e in t["best_epoch_per_fold"])),
        row("stopped early", lambda t: ", ".join("yes" if s else "no" for s in t["stopped_early_per_fold"])),
        row("peak memory", lambda t: _gib(t["peak_memory_bytes"])),
    ]


def _cost_table(timing: dict) -> list[str]:
    return _markdown(*cost_table_rows(timing))


def print_comparison(comparison: dict, console) -> None:
    """compare.md's two tables on `console` (validation metrics over the paired cases, training cost); nothing
    for an empty comparison."""
    from brats_swap.evaluate.tables import print_results_table

    if not comparison:
        return
    if comparison["paired_cases"]:
        print_results_table(console, *metric_table_rows(comparison),
                            title=f"whole volume vs patches: {comparison['paired_cases']} paired validation cases",
                            caption=f"per-case mean ± std ({STD_NOTE})")
    print_results_table(console, *cost_table_rows(comparison["timing"]), title="training cost",
                        caption="a step and an epoch's training timed apart from validation")


def _epoch_note(config: Config) -> str:
    """What an epoch is in both arms (the sentence under the cost table)."""
    validation = ("Validation, every `train.val_every` epoch(s), is timed apart: it predicts the validation cases "
                  "whatever the number of training steps.")
    if config.train.steps_per_epoch is not None:
        return (f"An epoch is `train.steps_per_epoch` = {config.train.steps_per_epoch} training step(s) in both "
                f"arms, not a pass over the training cases, so compare the step times: a step is one batch of "
                f"{config.train.batch_size} whole volume(s) or patch(es). {validation}")
    return ("An epoch is one pass over the training cases in both arms (`train.patches_per_case` patch(es) per case "
            f"for patches), so the epoch times compare the cost of one sample of each kind. {validation}")


def render_compare_markdown(config: Config, comparison: dict, run: RunFolder) -> str:
    """compare.md, linking all three figures (write_comparison drops the links of figures not drawn)."""
    folds_compared = comparison["folds_compared"]
    return "\n".join([
        f"# Whole volume vs patches: {config.name}",
        "",
        f"Whole volumes of {'×'.join(map(str, config.data.cube))} (memory mode `{config.memory.mode}`) versus "
        f"{'×'.join(map(str, config.train.patch))} patches (sliding-window inference), same folds. "
        f"Folds compared: {', '.join(map(str, folds_compared)) or 'none yet'} "
        f"({len(folds_compared)} of the {len(comparison['folds'])} requested); "
        f"{comparison['paired_cases']} validation cases, each evaluated by both models.",
        f"Written {comparison['generated_at']}.",
        "",
        "## Validation metrics (per-case mean ± std)",
        "",
        *_metric_table(comparison),
        "",
        f"{STD_NOTE}.",
        "",
        *_official_table(comparison.get("official")),
        "## Training cost",
        "",
        *_cost_table(comparison["timing"]),
        "",
        *_cpu_memory_note(comparison),
        _epoch_note(config),
        "",
        f"![paired Dice]({run.relative(run.compare_boxplot)})",
        "",
        f"![largest differences]({run.relative(run.compare_overlays)})",
        "",
        f"![training curves]({run.relative(run.training_curves)})",
        "",
    ])


def write_comparison(config: Config, run_dir: RunFolder | Path, folds: list[int]) -> dict:
    """Draw the figures and write compare.json and compare.md into the comparison folder; return the numbers."""
    run = RunFolder.of(run_dir)
    comparison = build_comparison(run, folds)
    drawn = []
    if comparison["paired_cases"]:
        paired_boxplot(comparison, run.compare_boxplot)
        drawn.append(run.compare_boxplot)
        if overlay_figure(config, run, comparison, run.compare_overlays):
            drawn.append(run.compare_overlays)
    if training_curves(run, folds, run.training_curves):
        drawn.append(run.training_curves)
    comparison["figures"] = [run.relative(path) for path in drawn]
    atomic_write_json(run.compare_json, json_safe(comparison))  # NaN -> null, inf -> "inf"
    markdown = render_compare_markdown(config, comparison, run)
    # Link only the figures that exist (e.g. no overlays when predictions were not saved).
    for figure in (run.compare_boxplot, run.compare_overlays, run.training_curves):
        link = run.relative(figure)
        if link not in comparison["figures"]:
            markdown = "\n".join(line for line in markdown.splitlines() if f"({link})" not in line)
    atomic_write_text(run.compare_md, markdown + "\n")
    return comparison


__all__ = ["build_comparison", "cost_table_rows", "metric_table_rows", "print_comparison", "render_compare_markdown",
           "write_comparison"]
