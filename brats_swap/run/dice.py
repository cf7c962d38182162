"""Overlap of binary masks with the CaPTk rules for empty masks (the BraTS 2017-2021 evaluation tools).

On the boolean masks P (prediction) and T (truth) of one region of one case:

    Dice         2|P∩T| / (|P|+|T|)     1 if both are empty (so 0 if exactly one is empty)
    sensitivity  |P∩T| / |T|            1 if both are empty, 0 if T is empty and P is not
    specificity  TN / (TN+FP)           over every voxel of the grid; 1 if T covers the whole grid

Training's validation Dice and evaluation's metrics both count with `dice_sensitivity_specificity`, so the
model is selected by exactly the number the reports show.
"""

from __future__ import annotations

import numpy as np

from brats_swap.data.editions import REGIONS, EditionSpec, get_edition, region_masks


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


def region_dice(pred_label: np.ndarray, true_label: np.ndarray, edition: EditionSpec | str) -> dict[str, float]:
    """Dice per region of two label maps (raw edition label values, same grid): {"dice_wt", "dice_tc", "dice_et"}."""
    spec = get_edition(edition) if isinstance(edition, str) else edition
    pred_regions = region_masks(pred_label, spec)
    true_regions = region_masks(true_label, spec)
    return {f"dice_{region.lower()}": dice_sensitivity_specificity(pred_regions[region], true_regions[region])[0]
            for region in REGIONS}
