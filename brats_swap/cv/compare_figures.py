"""The figures of `compare --patch` (matplotlib, Agg backend, PNG, written atomically and reproducibly)."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from brats_swap.config import Config
from brats_swap.cv.fold_progress import read_fold_state
from brats_swap.data.challenges import get_challenge, isin
from brats_swap.data.nifti import to_table_values
from brats_swap.errors import DataError
from brats_swap.run.dice import dice_column
from brats_swap.run.figures import pyplot, savefig_deterministic
from brats_swap.run.folder import COMPARE_ARMS, RunFolder

ARM_TITLES = {"full": "whole volume", "patch": "patches"}
ARM_COLOURS = {"full": "tab:blue", "patch": "tab:orange"}
# Overlay RGBA per region, painted in the run's region order (largest first, so nested regions show on top):
# the BraTS colours edema green, tumour core red, enhancing yellow; cavity blue, cyst cyan, GTV red.
REGION_COLOURS = {"WT": (0.1, 0.8, 0.1, 0.45), "TC": (0.9, 0.1, 0.1, 0.55), "ET": (1.0, 0.9, 0.0, 0.65),
                  "RC": (0.2, 0.4, 1.0, 0.55), "CC": (0.0, 0.9, 0.9, 0.6), "GTV": (0.9, 0.1, 0.1, 0.55)}
OTHER_REGION_COLOUR = (0.8, 0.3, 0.9, 0.55)  # a region chosen with model.regions (NETC, SNFH, ED, ...)
LEGEND_BAND = 0.1  # share of a one-row figure's height kept below the axes for its legend


def paired_boxplot(comparison: dict, path: Path) -> None:
    """Per region, whole-volume and patch Dice side by side, each case's pair joined by a line (Fig. 5)."""
    plt = pyplot()
    cases, regions = comparison["cases"], comparison["regions"]
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for i, region in enumerate(regions):
        full = [c[f"full_{dice_column(region)}"] for c in cases]
        patch = [c[f"patch_{dice_column(region)}"] for c in cases]
        positions = (3 * i + 1, 3 * i + 2)
        for values, position, arm in ((full, positions[0], "full"), (patch, positions[1], "patch")):
            box = axis.boxplot([values], positions=[position], widths=0.6, showfliers=False, patch_artist=True)
            for artist in box["boxes"]:
                artist.set_facecolor(ARM_COLOURS[arm])
                artist.set_alpha(0.35)
        for a, b in zip(full, patch, strict=True):
            axis.plot(positions, (a, b), color="grey", alpha=0.4, linewidth=0.8, marker="o", markersize=2.5)
    axis.set_xticks([3 * i + 1.5 for i in range(len(regions))], regions)
    axis.set_ylim(-0.02, 1.02)
    axis.set_ylabel("Dice (per case)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=ARM_COLOURS[a], alpha=0.35) for a in COMPARE_ARMS]
    # Below the axes, not inside: any corner of the plot can hold boxes (Dice near 0 or near 1).
    figure.legend(handles, [ARM_TITLES[a] for a in COMPARE_ARMS], loc="lower center", ncol=len(COMPARE_ARMS),
                  frameon=False)
    axis.set_title(f"Whole volume vs patches, {comparison['paired_cases']} validation cases")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout(rect=(0, LEGEND_BAND, 1, 1))
    savefig_deterministic(figure, path)
    plt.close(figure)


def _label_rgb(label_slice: np.ndarray, edition: str, regions: list[str]) -> np.ndarray:
    """RGBA overlay of the run's regions (`REGION_COLOURS`): for WT/TC/ET edema green, tumour core
    (non-enhancing) red, enhancing yellow, the BraTS colours."""
    spec = get_challenge(edition)
    rgba = np.zeros(label_slice.shape + (4,), dtype=np.float32)
    for region in regions:
        rgba[isin(label_slice, spec.groups[region])] = REGION_COLOURS.get(region, OTHER_REGION_COLOUR)
    return rgba


def _case_files(config: Config) -> dict:
    from brats_swap.data.discovery import discover_cases

    return {case.case_id: case for case in discover_cases(config.data.root, config.data.edition, config.data.modalities,
                                                          config.data.challenge)}


def _overlay_panels(config: Config, run: RunFolder, comparison: dict, n_cases: int) -> list[tuple]:
    """(case, image slice, truth slice, {arm: predicted slice}, edition) for the cases whose mean Dice differs
    most between the arms and whose ground truth and both predictions are on disk."""
    import nibabel as nib

    def mean_dice(case: dict, arm: str) -> float:
        return statistics.fmean(case[f"{arm}_{dice_column(r)}"] for r in comparison["regions"])

    ranked = sorted(comparison["cases"], key=lambda c: -abs(mean_dice(c, "full") - mean_dice(c, "patch")))
    try:
        files = _case_files(config)
    except DataError:
        return []
    panels = []
    for case in ranked[:n_cases]:
        source = files.get(case["case"])
        predictions = {arm: run.arm(arm).fold(case["fold"]).prediction(case["case"]) for arm in COMPARE_ARMS}
        if source is None or source.seg is None or not all(p.exists() for p in predictions.values()):
            continue
        truth = np.asarray(nib.load(source.seg).dataobj).astype(np.uint8)
        if source.relabelled:  # an nnU-Net or Decathlon folder: its own label values, shown in the table's
            truth = to_table_values(f"case {source.case_id}", truth, source.label_map, get_challenge(source.edition),
                                    source.description)
        # Show the modality where the tumour is most visible: FLAIR (edema), else the first available.
        image_path = source.images.get("flair") or next(iter(source.images.values()))
        image = np.asarray(nib.load(image_path).dataobj, dtype=np.float32)
        predicted = {arm: np.asarray(nib.load(p).dataobj).astype(np.uint8) for arm, p in predictions.items()}
        tumour_per_slice = (truth > 0).sum(axis=(0, 1))
        z = int(np.argmax(tumour_per_slice))
        panels.append((case, image[:, :, z], truth[:, :, z], {a: predicted[a][:, :, z] for a in COMPARE_ARMS}, source.edition))
    return panels


def overlay_figure(config: Config, run_dir: RunFolder | Path, comparison: dict, path: Path, n_cases: int = 3) -> bool:
    """Ground truth vs both predictions on the axial slice with most tumour, for the cases whose mean Dice
    differs most between the arms (Fig. 6). False when predictions or ground truth are not on disk."""
    panels = _overlay_panels(config, RunFolder.of(run_dir), comparison, n_cases)
    if not panels:
        return False
    regions = comparison["regions"]
    plt = pyplot()
    figure, axes = plt.subplots(len(panels), 3, figsize=(9, 3.1 * len(panels)), squeeze=False)
    for row, (case, image, truth, predicted, edition) in enumerate(panels):
        columns = [("ground truth", truth)] + [
            (f"{ARM_TITLES[a]} (Dice {'/'.join(regions)} "
             + "/".join(f"{case[f'{a}_{dice_column(r)}']:.2f}" for r in regions) + ")", predicted[a]) for a in COMPARE_ARMS
        ]
        for col, (title, label) in enumerate(columns):
            axis = axes[row][col]
            # Radiological view: rows = y, columns = x, anterior up.
            axis.imshow(np.rot90(image), cmap="gray")
            axis.imshow(np.rot90(_label_rgb(label, edition, regions)))
            axis.set_title(f"{case['case']}\n{title}" if col == 0 else title, fontsize=8)
            axis.axis("off")
    figure.suptitle("Largest whole-volume vs patch differences (axial slice with most tumour)", fontsize=10)
    key = [plt.Rectangle((0, 0), 1, 1, color=REGION_COLOURS.get(r, OTHER_REGION_COLOUR)) for r in regions]
    figure.legend(key, regions, loc="lower center", ncol=len(regions), frameon=False, fontsize=8,
                  title="colour key (nested regions painted over)", title_fontsize=8)
    figure.tight_layout(rect=(0, LEGEND_BAND / len(panels), 1, 1))
    savefig_deterministic(figure, path)
    plt.close(figure)
    return True


def training_curves(run_dir: RunFolder | Path, folds: list[int], path: Path) -> bool:
    """Training loss and validation Dice per epoch, both arms, every fold (False when no history yet)."""
    run = RunFolder.of(run_dir)
    histories = {arm: {k: read_fold_state(run.arm(arm), k).history for k in folds} for arm in COMPARE_ARMS}
    if not any(h for by_fold in histories.values() for h in by_fold.values()):
        return False
    plt = pyplot()
    figure, (loss_axis, dice_axis) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm in COMPARE_ARMS:
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


__all__ = ["ARM_TITLES", "overlay_figure", "paired_boxplot", "training_curves"]
