"""Contrast (batchgeneratorsv2's ContrastTransform, preserve_range=True, synchronize_channels=False): with p,
each channel's values moved around its mean by a factor of its own, clamped to its original range."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from brats_swap.augment.ranges import BGContrastRange, draw_per_channel
from brats_swap.augment.steps import channel_view, chosen_channels, column, temporaries_bytes


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
class Contrast:
    p: float
    factor: BGContrastRange
    name: ClassVar[str] = "contrast"

    def neutral(self, channels: int) -> tuple[float, ...]:
        return (1.0,) * channels

    def draw(self, rng: np.random.Generator, channels: int) -> tuple[float, ...]:
        return draw_per_channel(rng, self.p, 1.0, self.factor, channels, 1.0)

    def apply(self, images, labels, values, seeds) -> None:
        contrast(images, *chosen_channels(values, 1.0))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # the gathered channels and up to four temporaries of their size
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=5)
