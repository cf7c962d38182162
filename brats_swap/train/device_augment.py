"""A loader batch on the training device: moved there, augmented by its recipe, turned into targets.

The split (docs/augmentation.md): the loader's workers read the compressed float16 cache, crop (the crop
the recipe asks for: an enlarged crop for the nnU-Net recipes in patch mode, so that a rotated or scaled
patch has no padded corners) and pin; the batch travels to the device as float16 plus uint8 labels;
`DeviceBatches.prepare` converts it there, augments it as `train.augment` says (`brats_swap.augment`) and
builds the targets from the augmented labels (the deep-supervision targets follow in the loss, which takes
the targets to each output's resolution).

Every random parameter is drawn in the worker, by the recipe's `draw`, from the sample's own generator
(seeded by seed, epoch and the sample's global position, `train/data.py`), and travels with the batch: the
device side draws nothing. So a mid-epoch resume re-creates the same augmentation bitwise, the stream does
not depend on the number of workers, and two ranks (which load different global positions) never draw the
same augmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from brats_swap.augment import get_recipe
from brats_swap.data.challenges import get_challenge
from brats_swap.model.targets import targets_from_labels

if TYPE_CHECKING:
    from brats_swap.train.data import LoaderBatch


def arrived_batch_bytes(recipe: str, batch: int, channels: int, sample_size: Sequence[int], patch_mode: bool) -> int:
    """Bytes of one batch as the loader hands it over (and as it lands on the device): float16 images and
    uint8 labels, each sample the crop its worker reads (the recipe's `crop_size`)."""
    crop = get_recipe(recipe).crop_size(sample_size, patch_mode)
    return batch * int(np.prod(crop)) * (channels * 2 + 1)


def augment_buffers(recipe: str, batch: int, channels: int, sample_size: Sequence[int], num_labels: int,
                    patch_mode: bool) -> int:
    """Device bytes the augmentation of one batch holds at its peak besides the float32 batch it returns: the
    float16 batch as it arrived and the recipe's own buffers (`buffer_bytes`: sampling grids, label channels,
    copies). All of it is freed before the forward starts (`DeviceBatches.prepare` returns only the
    augmented batch)."""
    chosen = get_recipe(recipe)
    crop = chosen.crop_size(sample_size, patch_mode)
    arrived = arrived_batch_bytes(recipe, batch, channels, sample_size, patch_mode)
    return arrived + int(chosen.buffer_bytes(batch, channels, tuple(sample_size), num_labels, crop))


def restore_windows(images: torch.Tensor, labels: torch.Tensor, pads: Sequence[tuple[int, ...] | None]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's enlarged crop from the block its worker read (`train.data.enlarged_window`): padded with
    zeros (outside the volume: outside the brain) or cropped, sample by sample as the widths differ."""
    import torch.nn.functional as F

    padded = [(F.pad(image, pad), F.pad(label, pad)) if pad is not None else (image, label)
              for image, label, pad in zip(images, labels, pads, strict=True)]
    return torch.stack([image for image, _ in padded]), torch.stack([label for _, label in padded])


class DeviceBatches:
    """Turns a loader batch (float16 images, uint8 labels, per-sample parameters) into the step's float32
    images and targets on `device`, augmented as `recipe` says."""

    def __init__(self, recipe: str, device: torch.device, *, edition: str, outputs: str, regions: Sequence[str],
                 sample_size: Sequence[int], label_order: Sequence[int] = ()) -> None:
        self.recipe, self.device = get_recipe(recipe), device
        self.edition, self.outputs, self.regions = edition, outputs, tuple(regions)
        self.label_order = tuple(label_order)
        self.sample_size = tuple(int(v) for v in sample_size)
        self.label_values = (0, *get_challenge(edition).label_values)  # background included

    def prepare(self, batch: LoaderBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(images float32 (B, C, *sample), targets float32 (B, outputs, *sample)) on the device."""
        images = batch.image.to(self.device, non_blocking=True).float()
        labels = batch.label.to(self.device, non_blocking=True).long()
        if any(pad is not None for pad in batch.pad):
            images, labels = restore_windows(images, labels, batch.pad)
        images, labels = self.recipe.apply(images, labels, batch.augment, self.sample_size, self.label_values)
        targets = targets_from_labels(labels, self.edition, self.outputs, self.regions, self.label_order).float()
        return images, targets
