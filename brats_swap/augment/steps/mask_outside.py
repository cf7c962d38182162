"""nnU-Net's last two transforms: MaskImageTransform (the image zeroed in every channel where the label is -1,
outside the brain or outside the input) and RemoveLabelTansform(-1, 0). It draws nothing; a recipe ends with
it, or -1 labels would reach the loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from brats_swap.augment.spatial import BACKGROUND, OUTSIDE_LABEL
from brats_swap.augment.steps import temporaries_bytes


@dataclass(frozen=True)
class MaskOutside:
    """Value: none (it draws nothing and consumes nothing of the sample's generator)."""

    name: ClassVar[str] = "mask_outside"

    def neutral(self, channels: int) -> None:
        return None

    def draw(self, rng: np.random.Generator, channels: int) -> None:
        return None

    def apply(self, images, labels, values, seeds) -> None:
        outside = labels == OUTSIDE_LABEL
        images.masked_fill_(outside[:, None], 0.0)
        labels.masked_fill_(outside, BACKGROUND)

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, voxel_bytes=1)  # the bool mask
