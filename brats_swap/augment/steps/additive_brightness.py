"""Additive brightness (batchgeneratorsv2's BrightnessAdditiveTransform, mu 0, synchronize_channels=False,
p_per_channel 1): with p, each channel plus a shift of its own drawn from N(0, sigma)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from brats_swap.augment.steps import per_channel_tensor


@dataclass(frozen=True)
class AdditiveBrightness:
    """Value: per channel, the shift added to every voxel; 0 = unchanged. When it fires, every channel
    draws (p_per_channel 1), so there is no per-channel probability."""

    p: float
    sigma: float
    name: ClassVar[str] = "additive_brightness"

    def neutral(self, channels: int) -> tuple[float, ...]:
        return (0.0,) * channels

    def draw(self, rng: np.random.Generator, channels: int) -> tuple[float, ...]:
        if rng.random() < self.p:
            return tuple(float(v) for v in rng.normal(0.0, self.sigma, channels))
        return self.neutral(channels)

    def apply(self, images, labels, values, seeds) -> None:
        images.add_(per_channel_tensor(values, images))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        return 0  # in place
