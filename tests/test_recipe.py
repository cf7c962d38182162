"""The training recipe of `train.*`: nnU-Net's deep-supervision weights, region loss, SGD, poly schedule and
gradient clipping, against nnU-Net's own formulas."""

from __future__ import annotations

import pytest
import torch

from brats_swap.config import load_config
from brats_swap.train.losses import SegmentationLoss, deep_supervision_weights
from brats_swap.train.optim import build_optimizer, build_scheduler, clip_gradients, step_after_epoch


def test_deep_supervision_weights_halve_per_level_skip_the_lowest_and_sum_to_one():
    # nnU-Net v2 (nnUNetTrainer._build_loss): 1 / 2**i, the last set to 0, normalised.
    assert deep_supervision_weights(5) == pytest.approx([8 / 15, 4 / 15, 2 / 15, 1 / 15, 0.0])
    assert deep_supervision_weights(1) == [1.0]
    # Under DDP every parameter must get a gradient: nnU-Net gives the lowest output 1e-6.
    assert deep_supervision_weights(3, distributed=True)[-1] == pytest.approx(1e-6 / 1.500001)


def nnunet_region_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """nnU-Net's DC_and_BCE_loss with MemoryEfficientSoftDiceLoss (batch Dice, smooth 1e-5, every channel)."""
    probs = torch.sigmoid(logits)
    axes = (0, 2, 3, 4)
    intersect, sum_pred, sum_gt = (probs * target).sum(axes), probs.sum(axes), target.sum(axes)
    dice = (2 * intersect + 1e-5) / (sum_gt + sum_pred + 1e-5).clamp_min(1e-8)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, target) - dice.mean()


def test_dice_bce_is_nnunets_region_loss_over_the_deep_supervision_scales():
    torch.manual_seed(0)
    target = (torch.rand(2, 3, 8, 8, 8) > 0.6).float()
    outputs = [torch.randn(2, 3, 8, 8, 8), torch.randn(2, 3, 4, 4, 4), torch.randn(2, 3, 2, 2, 2)]
    loss = SegmentationLoss("dice_bce", from_logits=True)(outputs, target)
    weights = deep_supervision_weights(3)
    low = torch.nn.functional.interpolate(target, size=(4, 4, 4), mode="nearest")
    reference = weights[0] * nnunet_region_loss(outputs[0], target) + weights[1] * nnunet_region_loss(outputs[1], low)
    # MONAI's DiceLoss is 1 - Dice where nnU-Net's is -Dice: the same gradients, 1 apart (weights sum to 1).
    assert float(loss) == pytest.approx(float(reference) + 1.0, abs=1e-6)


def test_sgd_poly_and_gradient_clipping_follow_nnunet():
    config = load_config(None, ["train.optimizer=sgd", "train.lr=0.01", "train.weight_decay=3e-5",
                                "train.schedule=poly", "train.max_epochs=10", "train.grad_clip=1"])
    layer = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(layer.parameters(), config.train)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.SGD)
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.99, True, 3e-5)
    scheduler = build_scheduler(optimizer, config.train)
    for epoch in range(1, 4):
        optimizer.step()
        step_after_epoch(scheduler)
        assert group["lr"] == pytest.approx(0.01 * (1 - epoch / 10) ** 0.9)
    (layer(torch.ones(1, 4)) * 1000).sum().backward()
    clip_gradients(layer, optimizer, torch.amp.GradScaler("cpu", enabled=False), config.train.grad_clip)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in layer.parameters()]))
    assert float(norm) == pytest.approx(1.0, rel=1e-5)


def test_dice_ce_needs_label_outputs_and_a_network_with_logits():
    from brats_swap.config import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.loss: dice_ce"):
        load_config(None, ["model.name=resenc_l", "train.loss=dice_ce", "model.outputs=regions"])
    with pytest.raises(ConfigError, match=r"^train\.loss: dice_ce"):
        load_config(None, ["train.loss=dice_ce"])


def test_dice_bce_on_a_sigmoid_network_plans_on_the_meta_device():
    # The Isensee U-Net ends in a sigmoid: its BCE leaves autocast, which the meta device the planner traces on
    # does not have.
    from brats_swap.memory.planner import Planner
    from brats_swap.model import build_model
    from brats_swap.train.losses import training_loss

    config = load_config(None, ["train.loss=dice_bce", "model.base_filters=2", "data.cube=[16,16,16]"])
    model = build_model(config.model, 3)
    planner = Planner(model, (1, config.model.in_channels, 16, 16, 16),
                      loss_fn=training_loss(config.train.loss, model))
    assert planner.memory(config.memory).peak_bytes > 0
