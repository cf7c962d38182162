"""The nnU-Net recipes (`nnunet`, `nnunet_brats2020`): a recipe table (`recipes.py`: spatial parameters and
steps) drawn per sample in the worker, and `augment_batch` (`pipeline.py`) running its steps on the device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from brats_swap.augment import recipes
from brats_swap.augment.pipeline import augment_batch, augment_buffer_bytes
from brats_swap.augment.recipes import Recipe, SampleAugment
from brats_swap.augment.spatial import OUTSIDE_LABEL


def mark_outside_the_brain(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """nnU-Net's loader's labels: -1 on the background voxels outside the brain, zero in every channel (the
    cache's z-scored modalities are 0 there, and so is an enlarged crop past the volume); never a tumour
    voxel."""
    return labels.masked_fill((images == 0).all(dim=1) & (labels == 0), OUTSIDE_LABEL)


class NnunetAugment:
    def __init__(self, table: Recipe) -> None:
        self.table = table

    def crop_size(self, sample_size: Sequence[int], patch_mode: bool) -> tuple[int, int, int]:
        """In patch mode nnU-Net's enlarged patch (`get_patch_size`), so a rotated or scaled patch has no
        padded corners; a whole cube is read as it is."""
        if patch_mode:
            return tuple(int(v) for v in self.table.crop(self.table.spatial, tuple(sample_size)))  # type: ignore[return-value]
        return tuple(int(v) for v in sample_size)  # type: ignore[return-value]

    def draw(self, rng: np.random.Generator, sample_size: tuple[int, int, int], channels: int) -> SampleAugment:
        return self.table.draw(rng, tuple(sample_size), channels)

    def apply(self, images, labels, params, sample_size, label_values):
        labels = mark_outside_the_brain(images, labels)
        return augment_batch(images, labels, params, sample_size, label_values, steps=self.table.steps)

    def buffer_bytes(self, batch: int, channels: int, sample_size: Sequence[int], num_labels: int,
                     crop: Sequence[int]) -> int:
        return int(augment_buffer_bytes(batch, channels, tuple(sample_size), num_labels, tuple(crop),
                                        steps=self.table.steps))


NNUNET_V2 = NnunetAugment(recipes.NNUNET)
NNUNET_BRATS2020 = NnunetAugment(recipes.NNUNET_BRATS2020)
