"""Mirroring (batchgeneratorsv2's MirrorTransform over axes 0, 1, 2): each axis flipped with p_per_axis, image
and labels alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from brats_swap.augment.steps import temporaries_bytes


@dataclass(frozen=True)
class Mirror:
    """Value: whether each of the three spatial axes is flipped."""

    p_per_axis: float
    name: ClassVar[str] = "mirror"

    def neutral(self, channels: int) -> tuple[bool, bool, bool]:
        return (False, False, False)

    def draw(self, rng: np.random.Generator, channels: int) -> tuple[bool, bool, bool]:
        return tuple(bool(m) for m in rng.random(3) < self.p_per_axis)  # type: ignore[return-value]

    def apply(self, images, labels, values, seeds) -> None:
        for axis in range(3):
            flipped = [b for b, mirror in enumerate(values) if mirror[axis]]
            if flipped:
                images[flipped] = images[flipped].flip(axis + 2)
                labels[flipped] = labels[flipped].flip(axis + 1)

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # the gathered samples and their flipped copy
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=2)
