"""Multiplicative brightness (batchgeneratorsv2's MultiplicativeBrightnessTransform, synchronize_channels=False):
with p, each channel times a factor of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from brats_swap.augment.ranges import BGContrastRange, UniformRange
from brats_swap.augment.steps import FactorPerChannel, per_channel_tensor


@dataclass(frozen=True)
class Brightness(FactorPerChannel):
    """Value: per channel, the multiplier; 1 = unchanged."""

    p: float
    range: UniformRange | BGContrastRange
    p_per_channel: float = 1.0
    name: ClassVar[str] = "brightness"

    def apply(self, images, labels, values, seeds) -> None:
        images.mul_(per_channel_tensor(values, images))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        return 0  # in place
