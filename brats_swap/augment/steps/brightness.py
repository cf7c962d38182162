"""Multiplicative brightness (batchgeneratorsv2's MultiplicativeBrightnessTransform, synchronize_channels=False):
with p, each channel times a factor of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from brats_swap.augment.ranges import BGContrastRange, UniformRange, draw_per_channel
from brats_swap.augment.steps import per_channel_tensor


@dataclass(frozen=True)
class Brightness:
    p: float
    multiplier: UniformRange | BGContrastRange
    name: ClassVar[str] = "brightness"

    def neutral(self, channels: int) -> tuple[float, ...]:
        return (1.0,) * channels

    def draw(self, rng: np.random.Generator, channels: int) -> tuple[float, ...]:
        return draw_per_channel(rng, self.p, 1.0, self.multiplier, channels, 1.0)

    def apply(self, images, labels, values, seeds) -> None:
        images.mul_(per_channel_tensor(values, images))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        return 0  # in place
