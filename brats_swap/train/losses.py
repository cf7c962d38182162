"""Ellis's weighted multi-label soft Dice loss (the loss the IBM paper trained with)."""

from __future__ import annotations

import torch


def weighted_dice_loss(probs: torch.Tensor, target: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """Negative mean soft Dice over (batch, channel): Ellis's `weighted_dice_coefficient_loss`.

        loss = - mean_{b,c}  2 * (sum_v y[b,c,v] p[b,c,v] + smooth/2) / (sum_v y[b,c,v] + sum_v p[b,c,v] + smooth)
             = - mean_{b,c}  (2 * sum_v y p + smooth) / (sum_v y + sum_v p + smooth)

    (Ellis@323c9d6:unet3d/metrics.py). v runs over the spatial voxels, p are the probabilities
    (B, C, D, H, W) and y the binary targets of the same shape. Every (sample, channel) pair weighs the
    same, so a small label counts as much as a large one ("weighted"). The range is [-1, 0]: -1 is a
    perfect prediction, and a channel that is empty in both target and prediction scores exactly -1
    thanks to the smoothing. Sums are taken in fp32 even when `probs` is bf16/fp16 under AMP.
    """
    if probs.shape != target.shape:
        raise ValueError(f"probabilities {tuple(probs.shape)} and targets {tuple(target.shape)} differ in shape")
    if probs.dim() < 3:
        raise ValueError(f"expected (B, C, *spatial) tensors, got shape {tuple(probs.shape)}")
    spatial = tuple(range(2, probs.dim()))
    p = probs.float()
    y = target.float()
    intersection = (y * p).sum(dim=spatial)
    denominator = y.sum(dim=spatial) + p.sum(dim=spatial)
    dice = 2.0 * (intersection + smooth / 2.0) / (denominator + smooth)
    return -dice.mean()
