"""`brats-swap compare --patch`: the paper's experiment, whole volumes versus patches, on the same folds.

Two cross-validation runs share one `splits.json`:

- `run_dir/full/`  — whole volumes (`train.mode=full`) with the configured memory policy (swap,
  recompute, hybrid or auto): the method of the paper;
- `run_dir/patch/` — random patches of `train.patch` (`train.mode=patch`), sliding-window inference over
  the whole volume at evaluation, no memory engine (`memory.mode=none`): the baseline as the paper ran it.

Folds are advanced alternately (full fold 0, patch fold 0, full fold 1, ...) so that a run stopped by
`--max-hours` already holds comparable pairs. Each arm is an ordinary cv run folder (its own lock,
`state.json`s, `cv.log`, `cv_summary.*`), so `brats-swap cv --run run_dir/full` works on it too.

Outputs in `run_dir/`: `compare.json`, `compare.md`, and `figures/compare_dice_boxplot.png` (paired box
plots per region, the paper's Fig. 5), `figures/compare_overlays.png` (ground truth vs both predictions
on the axial slice with most tumour, for the cases whose Dice differs most: Fig. 6),
`figures/training_curves.png` (loss and validation Dice per epoch, both arms).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from brats_swap.atomic import atomic_write_json, atomic_write_text
from brats_swap.config import Config
from brats_swap.config.loader import validate_config
from brats_swap.cv.lock import StopControl, run_lock
from brats_swap.cv.runner import CVOutcome, FoldRunner, append_cv_log, load_run_splits, logged_invocation
from brats_swap.cv.state import FoldState, fold_dir, read_fold_state
from brats_swap.cv.summary import (
    METRIC_TITLES,
    format_mean_std,
    read_case_rows,
    savefig_deterministic,
    utc_now,
)
from brats_swap.data.editions import REGIONS, region_masks
from brats_swap.errors import BratsSwapError, ConfigError, DataError
from brats_swap.splits import SPLITS_FILE, read_splits

ARMS = ("full", "patch")
ARM_TITLES = {"full": "whole volume", "patch": "patches"}
COMPARE_JSON = "compare.json"
COMPARE_MD = "compare.md"
BOXPLOT_PNG = "figures/compare_dice_boxplot.png"
OVERLAYS_PNG = "figures/compare_overlays.png"
CURVES_PNG = "figures/training_curves.png"
COMPARED_METRICS = ("dice", "sensitivity", "specificity", "hd95")


@dataclass
class CompareOutcome:
    run_dir: Path
    folds: list[int]
    arms: dict[str, CVOutcome] = field(default_factory=dict)
    stop_reason: str | None = None
    seconds: float = 0.0
    comparison: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(outcome.complete for outcome in self.arms.values()) and len(self.arms) == len(ARMS)

    def describe(self) -> str:
        parts = [f"{arm}: {outcome.describe()}" for arm, outcome in self.arms.items()]
        return " | ".join(parts) if parts else "did not start"


def arm_configs(config: Config) -> dict[str, Config]:
    """The two arms' configs: identical except for the training mode (and no memory engine for patches)."""
    full = copy.deepcopy(config)
    full.train.mode = "full"
    full.name = f"{config.name}-full"
    patch = copy.deepcopy(config)
    patch.train.mode = "patch"
    patch.memory = dataclasses.replace(copy.deepcopy(config.memory), mode="none")
    patch.name = f"{config.name}-patch"
    for arm_config in (full, patch):
        validate_config(arm_config)  # e.g. a patch larger than the cube is reported with its key
    return {"full": full, "patch": patch}


def share_splits(run_dir: Path, arm_dir: Path) -> None:
    """Copy the comparison's splits.json into an arm once; afterwards both must agree."""
    source = Path(run_dir) / SPLITS_FILE
    target = Path(arm_dir) / SPLITS_FILE
    splits = read_splits(source)
    if not target.exists():
        atomic_write_json(target, splits)
        return
    if read_splits(target)["folds"] != splits["folds"]:
        raise DataError(f"{target}: differs from {source}; both arms must use the same folds "
                        f"(copy {source} over it, or start a new comparison folder)")


def run_compare(config: Config, run_dir: Path, folds: int | None = None, max_hours: float | None = None,
                *, console=None, clock=time.monotonic) -> CompareOutcome:
    """Train and evaluate the first `folds` folds (default: all of cv.folds) in both arms, then compare.

    Resumable and locked like `run_cv`: the comparison folder and each arm folder are locked.
    """
    run_dir = Path(run_dir)
    max_hours = max_hours if max_hours is not None else config.cv.max_hours
    if max_hours is not None and max_hours <= 0:
        raise ConfigError(f"--max-hours {max_hours}: must be positive")
    configs = arm_configs(config)
    with run_lock(run_dir):
        stop = StopControl(max_hours, clock=clock)
        outcome = CompareOutcome(run_dir=run_dir, folds=[])
        try:
            with logged_invocation(run_dir, stop, lambda: "compare " + outcome.describe()), stop.on_sigterm():
                splits = load_run_splits(config, run_dir)
                n_folds = len(splits["folds"])
                count = n_folds if folds is None else folds
                if not 1 <= count <= n_folds:
                    raise ConfigError(f"--folds {count}: must be between 1 and {n_folds} (the folds in {SPLITS_FILE})")
                outcome.folds = list(range(count))
                arm_dirs = {arm: run_dir / arm for arm in ARMS}
                for arm in ARMS:
                    arm_dirs[arm].mkdir(parents=True, exist_ok=True)
                with run_lock(arm_dirs["full"]), run_lock(arm_dirs["patch"]):
                    for arm in ARMS:
                        share_splits(run_dir, arm_dirs[arm])
                    _advance_arms(configs, arm_dirs, outcome, stop, console)
                outcome.stop_reason = stop.reason
                outcome.comparison = write_comparison(config, run_dir, outcome.folds)
        finally:
            outcome.seconds = stop.elapsed_seconds
        return outcome


def _advance_arms(configs: dict[str, Config], arm_dirs: dict[str, Path], outcome: CompareOutcome,
                  stop: StopControl, console) -> None:
    started = time.monotonic()
    for arm in ARMS:
        outcome.arms[arm] = CVOutcome(run_dir=arm_dirs[arm], folds=list(outcome.folds))
    status = "exit 0"
    try:
        runners = {arm: FoldRunner(configs[arm], arm_dirs[arm], stop, console=console) for arm in ARMS}
        stopped = False
        for k in outcome.folds:
            for arm in ARMS:
                if not runners[arm].advance(k, outcome.arms[arm]):
                    stopped = True
                    break
            if stopped:
                break
        for arm in ARMS:
            states = runners[arm].states(outcome.folds)
            outcome.arms[arm].done = [k for k in outcome.folds if states[k].done]
            outcome.arms[arm].stop_reason = stop.reason
            outcome.arms[arm].summary = runners[arm].write_summary(outcome.folds)
    except BratsSwapError as exc:
        status = f"exit {exc.exit_code} ({exc.__class__.__name__})"
        raise
    finally:
        for arm in ARMS:
            arm_outcome = outcome.arms[arm]
            arm_outcome.seconds = time.monotonic() - started  # the whole compare call: arms alternate
            append_cv_log(arm_dirs[arm], f"{utc_now()} pid={os.getpid()} {arm_outcome.seconds:.1f}s {status}: "
                                         f"(compare) {arm_outcome.describe()}")


# --------------------------------------------------------------------------------------------------
# The comparison: tables, numbers and figures from the two arms' files.


def _paired_rows(run_dir: Path, folds: list[int]) -> dict[str, list[dict]]:
    """Per-case metric rows of the folds evaluated in both arms (same cases, same order)."""
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for k in folds:
        states = {arm: read_fold_state(run_dir / arm, k) for arm in ARMS}
        if not all(s.evaluated for s in states.values()):
            continue
        by_case = {arm: {r["case"]: r for r in read_case_rows(run_dir / arm, k)} for arm in ARMS}
        for case in sorted(set(by_case["full"]) & set(by_case["patch"])):
            for arm in ARMS:
                rows[arm].append(by_case[arm][case])
    return rows


def _stats(values: list[float]) -> dict:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(finite), "std": statistics.stdev(finite) if len(finite) > 1 else None,
            "n": len(finite)}


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


def _arm_timing(arm_dir: Path, folds: list[int]) -> dict:
    states: list[FoldState] = [read_fold_state(arm_dir, k) for k in folds]
    epoch_seconds = [s for state in states for s in state.epoch_seconds]
    return {
        "median_epoch_seconds": statistics.median(epoch_seconds) if epoch_seconds else None,
        "total_train_hours": sum(state.train_seconds for state in states) / 3600.0,
        "epochs_per_fold": [state.epochs_completed for state in states],
        "best_epoch_per_fold": [state.best_epoch for state in states],
        "stopped_early_per_fold": [state.stopped_early for state in states],
        "peak_memory_bytes": max((state.peak_memory_bytes for state in states), default=0),
        "folds_done": [state.fold for state in states if state.done],
        "device": _run_device(arm_dir),
    }


def _run_device(arm_dir: Path) -> str | None:
    """The device the arm trained on, from the env.json the training loop writes into the run folder."""
    try:
        return json.loads((Path(arm_dir) / "env.json").read_text(encoding="utf-8")).get("device")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def build_comparison(run_dir: Path, folds: list[int]) -> dict:
    rows = _paired_rows(run_dir, folds)
    cases = len(rows["full"])
    metrics: dict = {}
    for metric in COMPARED_METRICS:
        for region in REGIONS:
            column = f"{metric}_{region.lower()}"
            if not all(column in r for arm in ARMS for r in rows[arm]) or not cases:
                continue
            values = {arm: [r[column] for r in rows[arm]] for arm in ARMS}
            differences = [a - b for a, b in zip(values["full"], values["patch"], strict=True)]
            finite_differences = [d for d in differences if math.isfinite(d)]
            metrics.setdefault(metric, {})[region] = {
                "full": _stats(values["full"]),
                "patch": _stats(values["patch"]),
                "difference": statistics.fmean(finite_differences) if finite_differences else None,
                "full_better_cases": sum(d > 0 for d in finite_differences) if metric != "hd95"
                else sum(d < 0 for d in finite_differences),
                "wilcoxon_p": _wilcoxon_p(differences),
            }
    return {
        "generated_at": utc_now(),
        "folds": folds,
        "folds_compared": sorted({r["fold"] for r in rows["full"]}),
        "paired_cases": cases,
        "metrics": metrics,
        "timing": {arm: _arm_timing(run_dir / arm, folds) for arm in ARMS},
        "cases": [
            {"case": f["case"], "fold": f["fold"],
             **{f"{arm}_dice_{r.lower()}": row.get(f"dice_{r.lower()}") for arm, row in (("full", f), ("patch", p))
                for r in REGIONS}}
            for f, p in zip(rows["full"], rows["patch"], strict=True)
        ],
    }


def _fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if value is None:
        return "—"
    if abs(value) < 0.5 * 10**-digits:
        value = 0.0  # no "-0.000"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _gib(n_bytes: int | None) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes else "—"


def _cpu_memory_note(comparison: dict) -> list[str]:
    if not any(str(comparison["timing"][arm].get("device", "")).startswith("cpu") for arm in ARMS):
        return []
    return ["On CPU the training loop reports the process's peak resident memory, which only grows: when both arms "
            "train in one process, the second arm's figure includes the first's, so it does not compare them.", ""]


def render_compare_markdown(config: Config, comparison: dict) -> str:
    timing = comparison["timing"]
    folds_compared = comparison["folds_compared"]
    lines = [
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
        "| metric | region | whole volume | patches | difference (whole − patch) | whole better | Wilcoxon p |",
        "|---|---|---|---|---|---|---|",
    ]
    for metric, by_region in comparison["metrics"].items():
        digits = 2 if metric == "hd95" else 3
        for region, cell in by_region.items():
            lines.append(
                f"| {METRIC_TITLES[metric]} | {region} | {format_mean_std(cell['full'], digits)} "
                f"| {format_mean_std(cell['patch'], digits)} | {_fmt(cell['difference'], digits, signed=True)} "
                f"| {cell['full_better_cases']}/{cell['full']['n']} | {_fmt(cell['wilcoxon_p'], 3)} |"
            )
    lines += [
        "",
        "## Training cost",
        "",
        "| | whole volume | patches |",
        "|---|---|---|",
        "| one epoch (median, s) | " + " | ".join(_fmt(timing[a]["median_epoch_seconds"], 1) for a in ARMS) + " |",
        "| total training (h) | " + " | ".join(_fmt(timing[a]["total_train_hours"], 3) for a in ARMS) + " |",
        "| epochs per fold | " + " | ".join(", ".join(map(str, timing[a]["epochs_per_fold"])) for a in ARMS) + " |",
        "| best epoch per fold | " + " | ".join(
            ", ".join("—" if e is None else str(e) for e in timing[a]["best_epoch_per_fold"]) for a in ARMS) + " |",
        "| stopped early | " + " | ".join(
            ", ".join("yes" if s else "no" for s in timing[a]["stopped_early_per_fold"]) for a in ARMS) + " |",
        "| peak memory | " + " | ".join(_gib(timing[a]["peak_memory_bytes"]) for a in ARMS) + " |",
        "",
        *_cpu_memory_note(comparison),
        "An epoch is one pass over the training cases in both arms (`train.patches_per_case` patch(es) per case "
        "for patches), so the epoch times compare the cost of one sample of each kind.",
        "",
        f"![paired Dice]({BOXPLOT_PNG})",
        "",
        f"![largest differences]({OVERLAYS_PNG})",
        "",
        f"![training curves]({CURVES_PNG})",
        "",
    ]
    return "\n".join(lines)


def write_comparison(config: Config, run_dir: Path, folds: list[int]) -> dict:
    comparison = build_comparison(run_dir, folds)
    figures = []
    if comparison["paired_cases"]:
        paired_boxplot(comparison, run_dir / BOXPLOT_PNG)
        figures.append(BOXPLOT_PNG)
        if overlay_figure(config, run_dir, comparison, run_dir / OVERLAYS_PNG):
            figures.append(OVERLAYS_PNG)
    if training_curves(run_dir, folds, run_dir / CURVES_PNG):
        figures.append(CURVES_PNG)
    comparison["figures"] = figures
    atomic_write_json(run_dir / COMPARE_JSON, comparison)
    markdown = render_compare_markdown(config, comparison)
    # Link only the figures that exist (e.g. no overlays when predictions were not saved).
    for figure in (BOXPLOT_PNG, OVERLAYS_PNG, CURVES_PNG):
        if figure not in figures:
            markdown = "\n".join(line for line in markdown.splitlines() if f"({figure})" not in line)
    atomic_write_text(run_dir / COMPARE_MD, markdown + "\n")
    return comparison


# --------------------------------------------------------------------------------------------------
# Figures (matplotlib, Agg backend, PNG).


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


ARM_COLOURS = {"full": "tab:blue", "patch": "tab:orange"}


def paired_boxplot(comparison: dict, path: Path) -> None:
    """Per region, whole-volume and patch Dice side by side, each case's pair joined by a line (Fig. 5)."""
    plt = _pyplot()
    cases = comparison["cases"]
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for i, region in enumerate(REGIONS):
        key = region.lower()
        full = [c[f"full_dice_{key}"] for c in cases]
        patch = [c[f"patch_dice_{key}"] for c in cases]
        positions = (3 * i + 1, 3 * i + 2)
        for values, position, arm in ((full, positions[0], "full"), (patch, positions[1], "patch")):
            box = axis.boxplot([values], positions=[position], widths=0.6, showfliers=False, patch_artist=True)
            for artist in box["boxes"]:
                artist.set_facecolor(ARM_COLOURS[arm])
                artist.set_alpha(0.35)
        for a, b in zip(full, patch, strict=True):
            axis.plot(positions, (a, b), color="grey", alpha=0.4, linewidth=0.8, marker="o", markersize=2.5)
    axis.set_xticks([3 * i + 1.5 for i in range(len(REGIONS))], REGIONS)
    axis.set_ylim(-0.02, 1.02)
    axis.set_ylabel("Dice (per case)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=ARM_COLOURS[a], alpha=0.35) for a in ARMS]
    axis.legend(handles, [ARM_TITLES[a] for a in ARMS], loc="lower left")
    axis.set_title(f"Whole volume vs patches, {comparison['paired_cases']} validation cases")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    savefig_deterministic(figure, path)
    plt.close(figure)


def _label_rgb(label_slice: np.ndarray, edition: str) -> np.ndarray:
    """RGBA overlay: edema green, tumour core (non-enhancing) red, enhancing yellow (BraTS colours)."""
    masks = region_masks(label_slice, edition)
    rgba = np.zeros(label_slice.shape + (4,), dtype=np.float32)
    rgba[masks["WT"]] = (0.1, 0.8, 0.1, 0.45)
    rgba[masks["TC"]] = (0.9, 0.1, 0.1, 0.55)
    rgba[masks["ET"]] = (1.0, 0.9, 0.0, 0.65)
    return rgba


def _case_files(config: Config) -> dict:
    from brats_swap.data.discovery import discover_cases

    return {case.case_id: case for case in discover_cases(config.data.root, config.data.edition, config.data.modalities)}


def overlay_figure(config: Config, run_dir: Path, comparison: dict, path: Path, n_cases: int = 3) -> bool:
    """Ground truth vs both predictions on the axial slice with most tumour, for the cases whose mean Dice
    differs most between the arms (Fig. 6). False when predictions or ground truth are not on disk."""
    import nibabel as nib

    def mean_dice(case: dict, arm: str) -> float:
        return statistics.fmean(case[f"{arm}_dice_{r.lower()}"] for r in REGIONS)

    ranked = sorted(comparison["cases"], key=lambda c: -abs(mean_dice(c, "full") - mean_dice(c, "patch")))
    try:
        files = _case_files(config)
    except DataError:
        return False
    panels = []
    for case in ranked[:n_cases]:
        source = files.get(case["case"])
        predictions = {arm: fold_dir(run_dir / arm, case["fold"]) / "predictions" / f"{case['case']}.nii.gz"
                       for arm in ARMS}
        if source is None or source.seg is None or not all(p.exists() for p in predictions.values()):
            continue
        truth = np.asarray(nib.load(source.seg).dataobj).astype(np.uint8)
        # Show the modality where the tumour is most visible: FLAIR (edema), else the first available.
        image_path = source.images.get("flair") or next(iter(source.images.values()))
        image = np.asarray(nib.load(image_path).dataobj, dtype=np.float32)
        predicted = {arm: np.asarray(nib.load(p).dataobj).astype(np.uint8) for arm, p in predictions.items()}
        tumour_per_slice = (truth > 0).sum(axis=(0, 1))
        z = int(np.argmax(tumour_per_slice))
        panels.append((case, image[:, :, z], truth[:, :, z], {a: predicted[a][:, :, z] for a in ARMS}, source.edition))
    if not panels:
        return False
    plt = _pyplot()
    figure, axes = plt.subplots(len(panels), 3, figsize=(9, 3.1 * len(panels)), squeeze=False)
    for row, (case, image, truth, predicted, edition) in enumerate(panels):
        columns = [("ground truth", truth)] + [
            (f"{ARM_TITLES[a]} (Dice WT/TC/ET "
             + "/".join(f"{case[f'{a}_dice_{r.lower()}']:.2f}" for r in REGIONS) + ")", predicted[a]) for a in ARMS
        ]
        for col, (title, label) in enumerate(columns):
            axis = axes[row][col]
            # Radiological view: rows = y, columns = x, anterior up.
            axis.imshow(np.rot90(image), cmap="gray")
            axis.imshow(np.rot90(_label_rgb(label, edition)))
            axis.set_title(f"{case['case']}\n{title}" if col == 0 else title, fontsize=8)
            axis.axis("off")
    figure.suptitle("Largest whole-volume vs patch differences (axial slice with most tumour)", fontsize=10)
    figure.tight_layout()
    savefig_deterministic(figure, path)
    plt.close(figure)
    return True


def training_curves(run_dir: Path, folds: list[int], path: Path) -> bool:
    """Training loss and validation Dice per epoch, both arms, every fold (False when no history yet)."""
    histories = {arm: {k: read_fold_state(run_dir / arm, k).history for k in folds} for arm in ARMS}
    if not any(h for by_fold in histories.values() for h in by_fold.values()):
        return False
    plt = _pyplot()
    figure, (loss_axis, dice_axis) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm in ARMS:
        for k, history in histories[arm].items():
            if not history:
                continue
            label = f"{ARM_TITLES[arm]}, fold {k}"
            epochs = [e["epoch"] for e in history if e.get("train_loss") is not None]
            loss_axis.plot(epochs, [e["train_loss"] for e in history if e.get("train_loss") is not None],
                           color=ARM_COLOURS[arm], alpha=0.8, label=label, marker="o", markersize=3)
            validated = [e for e in history if e.get("val_dice_mean") is not None]
            dice_axis.plot([e["epoch"] for e in validated], [e["val_dice_mean"] for e in validated],
                           color=ARM_COLOURS[arm], alpha=0.8, label=label, marker="o", markersize=3)
    from matplotlib.ticker import MaxNLocator

    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("training loss")
    dice_axis.set_xlabel("epoch")
    dice_axis.set_ylabel("validation Dice (mean of regions)")
    dice_axis.set_ylim(-0.02, 1.02)
    for axis in (loss_axis, dice_axis):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    savefig_deterministic(figure, path)
    plt.close(figure)
    return True


def load_comparison(run_dir: Path) -> dict:
    path = Path(run_dir) / COMPARE_JSON
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read the comparison ({exc.__class__.__name__})") from exc
