"""Gamma (batchgeneratorsv2's GammaTransform with retain_stats, synchronize_channels=False), of the image or of
the inverted image (`invert`): with p, each channel a gamma of its own. nnU-Net runs it twice, inverted early
and plain late, so a recipe holds two instances (`gamma_inverted`, `gamma`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from brats_swap.augment.ranges import BGContrastRange
from brats_swap.augment.steps import FactorPerChannel, channel_view, column, temporaries_bytes

_EPS = 1e-7  # batchgeneratorsv2's gamma epsilon


def gamma(images: torch.Tensor, index: Sequence[int], gammas: Sequence[float], invert: bool) -> None:
    """batchgeneratorsv2's GammaTransform with retain_stats: optionally negate, rescale to [0, 1] by the
    channel's min and range, raise to gamma, scale back, restore the channel's mean and std (unbiased),
    negate back."""
    if not index:
        return
    flat = channel_view(images)
    rows = torch.tensor(index, device=images.device)
    sub = flat[rows]
    if invert:
        sub = -sub
    dims = tuple(range(1, sub.ndim))
    mean, std = sub.mean(dims, keepdim=True), sub.std(dims, keepdim=True)
    low, high = sub.amin(dims, keepdim=True), sub.amax(dims, keepdim=True)
    span = high - low
    sub = ((sub - low) / span.clamp_min(_EPS)).pow(column(gammas, sub)) * span + low
    here_mean, here_std = sub.mean(dims, keepdim=True), sub.std(dims, keepdim=True)
    sub = (sub - here_mean) * (std / here_std.clamp_min(_EPS)) + mean
    if invert:
        sub = -sub
    flat.index_copy_(0, rows, sub)


@dataclass(frozen=True)
class Gamma(FactorPerChannel):
    """Value: per channel, the gamma (of the inverted image with `invert`), mean and std kept; 1 =
    unchanged."""

    p: float
    range: BGContrastRange
    invert: bool
    p_per_channel: float = 1.0

    @property
    def name(self) -> str:
        return "gamma_inverted" if self.invert else "gamma"

    def apply(self, images, labels, values, seeds) -> None:
        gamma(images, *self.chosen(values), invert=self.invert)

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # the gathered channels and up to four temporaries of their size
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=5)
