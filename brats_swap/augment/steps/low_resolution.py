"""Simulated low resolution (batchgeneratorsv2's SimulateLowResolutionTransform, synchronize_axes=True,
synchronize_channels=False): with p, then on each channel with p_per_channel, nearest-exact down by a scale
of its own and trilinear back up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from brats_swap.augment.ranges import UniformRange
from brats_swap.augment.steps import FactorPerChannel, channel_view, temporaries_bytes


def low_resolution(images: torch.Tensor, index: Sequence[int], scales: Sequence[float]) -> None:
    """Nearest-exact down to round(size * scale) per axis, trilinear back up. One channel at a time: every
    chosen channel has a downsampled shape of its own, so they cannot share one interpolate call (about an
    eighth of the channels fire)."""
    flat = channel_view(images)
    shape = flat.shape[1:]
    for row, scale in zip(index, scales, strict=True):
        small = [round(size * scale) for size in shape]
        down = F.interpolate(flat[row][None, None], small, mode="nearest-exact")
        flat[row] = F.interpolate(down, shape, mode="trilinear")[0, 0]


@dataclass(frozen=True)
class LowResolution(FactorPerChannel):
    """Value: per channel, the down-scaling factor of every axis; 1 = unchanged."""

    p: float
    p_per_channel: float
    range: UniformRange
    name: ClassVar[str] = "low_resolution"

    def apply(self, images, labels, values, seeds) -> None:
        low_resolution(images, *self.chosen(values))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # one channel at a time, bounded by one image copy
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=1)
