"""Contrast (batchgeneratorsv2's ContrastTransform, preserve_range=True, synchronize_channels=False): with p,
each channel's values moved around its mean by a factor of its own, clamped to its original range."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from brats_swap.augment.ranges import BGContrastRange
from brats_swap.augment.steps import FactorPerChannel, channel_view, column, temporaries_bytes


def contrast(images: torch.Tensor, index: Sequence[int], factors: Sequence[float]) -> None:
    """(x - mean) * factor + mean, clamped to the channel's original min and max (preserve_range)."""
    if not index:
        return
    flat = channel_view(images)
    rows = torch.tensor(index, device=images.device)
    sub = flat[rows]
    dims = tuple(range(1, sub.ndim))
    mean = sub.mean(dims, keepdim=True)
    low, high = sub.amin(dims, keepdim=True), sub.amax(dims, keepdim=True)
    sub = torch.minimum(torch.maximum((sub - mean) * column(factors, sub) + mean, low), high)
    flat.index_copy_(0, rows, sub)


@dataclass(frozen=True)
class Contrast(FactorPerChannel):
    """Value: per channel, the factor around the channel's mean (its range kept); 1 = unchanged."""

    p: float
    range: BGContrastRange
    p_per_channel: float = 1.0
    name: ClassVar[str] = "contrast"

    def apply(self, images, labels, values, seeds) -> None:
        contrast(images, *self.chosen(values))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # the gathered channels and up to four temporaries of their size
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=5)
