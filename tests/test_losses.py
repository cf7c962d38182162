"""Ellis's weighted soft Dice loss against hand computations."""

from __future__ import annotations

import pytest
import torch

from brats_swap.train.losses import weighted_dice_loss


def test_against_a_hand_computation():
    # One sample, two channels, four voxels.
    probs = torch.tensor([[[0.9, 0.2, 0.0, 0.5], [0.1, 0.1, 0.1, 0.1]]])
    target = torch.tensor([[[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]])
    s = 1e-5
    # channel 0: sum(y*p) = 0.9 + 0.5 = 1.4, sum(y) = 2, sum(p) = 1.6
    dice0 = 2 * (1.4 + s / 2) / (2 + 1.6 + s)
    # channel 1: sum(y*p) = 0, sum(y) = 0, sum(p) = 0.4
    dice1 = 2 * (0 + s / 2) / (0 + 0.4 + s)
    expected = -(dice0 + dice1) / 2
    assert weighted_dice_loss(probs, target).item() == pytest.approx(expected, rel=1e-6)


def test_mean_over_batch_and_channels_not_pooled():
    # Sample 0 perfect on a big channel, sample 1 wrong on a one-voxel channel: each pair weighs 1/2.
    probs = torch.zeros(2, 1, 10)
    target = torch.zeros(2, 1, 10)
    probs[0, 0, :] = 1
    target[0, 0, :] = 1
    target[1, 0, 0] = 1
    loss = weighted_dice_loss(probs, target).item()
    dice_sample1 = (0 + 1e-5) / (1 + 1e-5)
    assert loss == pytest.approx(-(1.0 + dice_sample1) / 2, rel=1e-6)


def test_range_limits():
    target = (torch.rand(2, 3, 4, 4, 4) > 0.5).float()
    assert weighted_dice_loss(target.clone(), target).item() == pytest.approx(-1.0, abs=1e-6)
    # Empty target and empty prediction: exactly perfect.
    zeros = torch.zeros(1, 3, 2, 2, 2)
    assert weighted_dice_loss(zeros, zeros).item() == -1.0
    # Disjoint: close to 0.
    assert weighted_dice_loss(1 - target, target).item() == pytest.approx(0.0, abs=1e-5)


def test_gradient_and_low_precision_inputs():
    probs = torch.rand(1, 3, 4, 4, 4)
    target = (torch.rand(1, 3, 4, 4, 4) > 0.5).float()
    reference = weighted_dice_loss(probs, target)
    half = probs.to(torch.bfloat16).requires_grad_()
    loss = weighted_dice_loss(half, target)
    assert loss.dtype == torch.float32  # sums in fp32
    assert loss.item() == pytest.approx(reference.item(), abs=5e-3)
    loss.backward()
    assert half.grad is not None and torch.isfinite(half.grad.float()).all()


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        weighted_dice_loss(torch.rand(1, 3, 4, 4, 4), torch.rand(1, 2, 4, 4, 4))
