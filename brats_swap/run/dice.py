"""Overlap of binary masks with the CaPTk rules for empty masks (the BraTS 2017-2021 evaluation tools).

On the boolean masks P (prediction) and T (truth) of one region of one case:

    Dice         2|P∩T| / (|P|+|T|)     1 if both are empty (so 0 if exactly one is empty)
    sensitivity  |P∩T| / |T|            1 if both are empty, 0 if T is empty and P is not
    specificity  TN / (TN+FP)           over every voxel of the grid; 1 if T covers the whole grid

Training's validation Dice and evaluation's metrics both count with `dice_sensitivity_specificity`, so the
model is selected by exactly the number the reports show.

The regions are a run's (`brats_swap.model.targets.run_regions`: WT/TC/ET for 2017–2021, + RC, CC or GTV
for the 2023+ challenges that have them) and name the columns `dice_<region>` (lower-case). Logs,
summaries and comparisons read the regions back from those columns (`regions_of_columns`), so they show
whatever regions the run was scored on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from brats_swap.data.challenges import ChallengeSpec, get_challenge, isin
from brats_swap.model.targets import region_names

DICE_PREFIX = "dice_"


def dice_sensitivity_specificity(pred: np.ndarray, truth: np.ndarray) -> tuple[float, float, float]:
    """Dice, sensitivity and specificity of two boolean masks of the same shape, with the CaPTk empty rules."""
    pred = np.asarray(pred, dtype=bool)
    truth = np.asarray(truth, dtype=bool)
    if pred.shape != truth.shape:
        raise ValueError(f"prediction {pred.shape} and truth {truth.shape} masks differ in shape")
    true_pos = int(np.count_nonzero(pred & truth))
    pred_pos = int(np.count_nonzero(pred))
    truth_pos = int(np.count_nonzero(truth))
    false_pos = pred_pos - true_pos
    true_neg = truth.size - truth_pos - false_pos

    if pred_pos + truth_pos == 0:
        return 1.0, 1.0, 1.0
    dice = 2.0 * true_pos / (pred_pos + truth_pos)
    sensitivity = true_pos / truth_pos if truth_pos else 0.0  # empty truth, non-empty prediction
    negatives = true_neg + false_pos
    specificity = true_neg / negatives if negatives else 1.0
    return dice, sensitivity, specificity


def dice_column(region: str) -> str:
    """The column of a region's Dice: "WT" -> "dice_wt"."""
    return f"{DICE_PREFIX}{region.lower()}"


def regions_of_columns(columns: Iterable[str]) -> tuple[str, ...]:
    """The regions that `dice_<region>` columns (or record keys) name, in order of first appearance:
    ["case", "dice_wt", "dice_tc", "dice_et", "hd95_wt"] -> ("WT", "TC", "ET")."""
    found = dict.fromkeys(column[len(DICE_PREFIX):].upper() for column in columns if column.startswith(DICE_PREFIX))
    return tuple(found)


def region_dice(pred_label: np.ndarray, true_label: np.ndarray, edition: ChallengeSpec | str,
                regions: Sequence[str] | None = None) -> dict[str, float]:
    """Dice per region of two label maps (raw label values of the table, same grid): {"dice_wt": ..., ...}
    for `regions` (default: the table's default regions, WT/TC/ET for 2017–2021)."""
    spec = get_challenge(edition)
    return {dice_column(region): dice_sensitivity_specificity(isin(pred_label, spec.groups[region]),
                                                              isin(true_label, spec.groups[region]))[0]
            for region in region_names(spec, regions)}
