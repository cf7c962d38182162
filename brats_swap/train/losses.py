"""The training losses: Ellis's weighted multi-label soft Dice (the loss the IBM paper trained with), MONAI's
Dice + cross-entropy (nnU-Net's label loss for softmax outputs) and nnU-Net's region Dice + BCE, over
deep-supervision outputs with nnU-Net's weights.

nnU-Net's two losses take the Dice over the batch. Under DDP, as nnU-Net does, the Dice's sums are gathered
from every rank (`_gathered_batch_dice`), so that a step on N ranks is the global batch's step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from brats_swap.model import emits_logits


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


def deep_supervision_weights(outputs: int, distributed: bool = False, lowest_on: bool = False) -> list[float]:
    """nnU-Net's weights for `outputs` deep-supervision outputs (full resolution first): halving per level,
    the lowest-resolution output off, normalised to sum 1; a single output weighs 1. `distributed`: the
    lowest weighs 1e-6 instead, as in nnU-Net under DDP, whose gradient reduction waits for every parameter.
    `lowest_on`: MedNeXt's trainer, which plans one level more than its network has outputs, so that the
    lowest-resolution output keeps its halved weight."""
    if lowest_on and outputs > 1:
        return deep_supervision_weights(outputs + 1)[:outputs]
    if outputs == 1:
        return [1.0]
    weights = [1.0 / 2**level for level in range(outputs)]
    weights[-1] = 1e-6 if distributed else 0.0
    return [w / sum(weights) for w in weights]


def _at_resolution(target: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The binary targets at an output's resolution (nearest, as nnU-Net downsamples its segmentations)."""
    if target.shape[2:] == output.shape[2:]:
        return target
    return F.interpolate(target, size=output.shape[2:], mode="nearest")


class _AllGatherGrad(torch.autograd.Function):
    """`all_gather` (stacked, rank order) whose backward sums the ranks' gradients and keeps this rank's
    (nnU-Net's AllGatherGrad): a loss of the gathered values, the same on every rank, gives each rank N times
    its share of the global gradient, which DDP's mean over the N ranks turns into the global batch's."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rank = dist.get_rank()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank]


def _gathered_batch_dice(probs: torch.Tensor, target: torch.Tensor, smooth: float = 1e-5) -> torch.Tensor:
    """MONAI's DiceLoss(batch=True, smooth 1e-5) of the global batch under DDP: each channel's sums over this
    rank's batch, summed over the ranks (nnU-Net's MemoryEfficientSoftDiceLoss with `ddp` and `batch_dice`)."""
    dims = (0, *range(2, probs.dim()))
    sums = torch.stack([(probs * target).sum(dims), target.sum(dims), probs.sum(dims)])
    intersection, truth, predicted = _AllGatherGrad.apply(sums).sum(0)
    return (1.0 - (2.0 * intersection + smooth) / (truth + predicted + smooth)).mean()


def _gathers(output: torch.Tensor) -> bool:
    """Whether a loss under DDP can gather its Dice's sums here: a process group runs, and the output is real
    (the planner traces the loss on the meta device, on rank 0 alone)."""
    return dist.is_available() and dist.is_initialized() and output.device.type != "meta"


def _sigmoid_dice_bce(output: torch.Tensor, target: torch.Tensor, from_logits: bool,
                      gather: bool = False) -> torch.Tensor:
    """nnU-Net's region loss: BCE plus the soft Dice over the batch (smooth 1e-5, every channel) of the
    sigmoid outputs; `gather`: the Dice of the global batch under DDP. MONAI's DiceLoss is 1 + nnU-Net's
    (-Dice) form: the same gradients."""
    from monai.losses import DiceLoss  # imported where used: MONAI takes seconds to import

    if gather:
        dice = _gathered_batch_dice(torch.sigmoid(output) if from_logits else output, target)
    else:
        dice = DiceLoss(sigmoid=from_logits, batch=True, smooth_nr=1e-5, smooth_dr=1e-5)(output, target)
    if from_logits:
        return dice + F.binary_cross_entropy_with_logits(output, target)
    # A network that ends in a sigmoid: BCE on its probabilities, in fp32 (autocast refuses it in fp16). The
    # planner traces on the meta device, which has no autocast to leave.
    device = output.device.type
    outside_autocast = (torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device)
                        else contextlib.nullcontext())
    with outside_autocast:
        return dice + F.binary_cross_entropy(output.clamp(1e-7, 1 - 1e-7), target)


def _softmax_dice_ce(output: torch.Tensor, target: torch.Tensor, gather: bool = False) -> torch.Tensor:
    """nnU-Net's label loss (`DC_and_CE_loss` as nnUNetTrainer builds it: `MemoryEfficientSoftDiceLoss` over the
    batch, smooth 1e-5, background left out, on the softmax; plus cross-entropy of the logits; weights 1 and
    1). MONAI's DiceCELoss computes the same terms; its Dice is 1 + nnU-Net's (-Dice): the same gradients
    (tests/test_nnunet_softmax.py compares both with nnU-Net's own loss). `target`: one-hot, background first.
    `gather`: the Dice of the global batch under DDP."""
    from monai.losses import DiceCELoss  # imported where used: MONAI takes seconds to import

    loss = DiceCELoss(softmax=True, include_background=False, batch=True, smooth_nr=1e-5, smooth_dr=1e-5)
    if gather:
        return _gathered_batch_dice(torch.softmax(output, 1)[:, 1:], target[:, 1:]) + loss.ce(output, target)
    return loss(output, target)


class SegmentationLoss:
    """`train.loss` over a network's training outputs (one tensor, or a deep-supervision list full
    resolution first, each scale against the targets at its resolution with nnU-Net's weights).

    `from_logits`: the network's training outputs are logits (else sigmoid probabilities, the Isensee U-Net).
    dice: Ellis's weighted Dice of the probabilities; dice_ce: MONAI's DiceCELoss (sigmoid Dice + cross-entropy
    across the channels, for mutually exclusive label outputs; needs logits), and for `softmax` outputs
    nnU-Net's label loss (`_softmax_dice_ce`); dice_bce: nnU-Net's region loss.
    """

    def __init__(self, name: str, from_logits: bool, dice: Callable = weighted_dice_loss,
                 distributed: bool = False, lowest_on: bool = False, softmax: bool = False) -> None:
        if name == "dice_ce" and not from_logits:
            raise ValueError("dice_ce needs a network whose training outputs are logits")
        if softmax and name != "dice_ce":
            raise ValueError(f"softmax outputs train with dice_ce, not {name}")
        self.name, self.from_logits, self.dice, self.distributed = name, from_logits, dice, distributed
        self.lowest_on, self.softmax = lowest_on, softmax
        self.dice_ce = None
        if name == "dice_ce" and not softmax:
            from monai.losses import DiceCELoss  # imported where used: MONAI takes seconds to import

            self.dice_ce = DiceCELoss(sigmoid=True)

    def single(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        output = output.float()  # sums and logs in fp32 under AMP
        gather = self.distributed and _gathers(output)
        if self.softmax:
            return _softmax_dice_ce(output, target, gather)
        if self.name == "dice":
            return self.dice(torch.sigmoid(output) if self.from_logits else output, target)
        if self.dice_ce is not None:
            return self.dice_ce(output, target)
        return _sigmoid_dice_bce(output, target, self.from_logits, gather)

    def __call__(self, outputs: torch.Tensor | list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
        target = target.float()
        total = None
        for weight, output in zip(deep_supervision_weights(len(outputs), self.distributed, self.lowest_on), outputs, strict=True):
            if weight > 0:
                term = weight * self.single(output, _at_resolution(target, output))
                total = term if total is None else total + term
        return total


def training_loss(loss: str, model: torch.nn.Module, dice: Callable = weighted_dice_loss,
                  distributed: bool = False) -> SegmentationLoss:
    """The loss `train.loss` names, for `model`'s training outputs (logits or probabilities); `dice` is the
    weighted Dice the `dice` loss applies to probabilities; `distributed`: trained under DDP."""
    return SegmentationLoss(loss, from_logits=emits_logits(model), dice=dice, distributed=distributed,
                            lowest_on=bool(getattr(model, "weighs_lowest_output", False)),
                            softmax=getattr(model, "output_kind", None) == "softmax")
