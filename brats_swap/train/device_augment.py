"""The training augmentation, on the training device, on the whole batch; then the targets.

The split (docs/augmentation.md): the loader's workers read the memory-mapped float16 cache, crop (an
enlarged crop for the nnU-Net recipes in patch mode, so that a rotated or scaled patch has no padded
corners) and pin; the batch travels to the device as float16 plus uint8 labels; `DeviceBatches.prepare`
converts it there, augments it as `train.augment` says and builds the targets from the augmented labels
(the deep-supervision targets follow in the loss, which takes the targets to each output's resolution).

Every random parameter is drawn in the worker, by `draw_params`, from the sample's own generator (seeded by
seed, epoch and the sample's global position, `train/data.py`), and travels with the batch: the device
side draws nothing. So a mid-epoch resume re-creates the same augmentation bitwise, the stream does not
depend on the number of workers, and two ranks (which load different global positions) never draw the
same augmentation.

Recipes (`train.augment`):
- cube48: one of the 48 rotations/reflections of the cube (those that keep the sample's shape), the
  paper's; permutes and flips of each sample's tensors.
- nnunet, nnunet_brats2020: nnU-Net v2's default training transforms, and the stronger set of its BraTS
  2020 entry (`brats_swap.augment`, shown equal to batchgeneratorsv2 given the same parameters).
- mild: a light MONAI set (small affine, intensity scale and shift, noise), run by MONAI on the device's
  tensors, sample by sample from the sample's seed.
- none.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from brats_swap.augment import (
    OUTSIDE_LABEL,
    augment_batch,
    augment_buffer_bytes,
    draw_sample_augment,
    enlarged_crop_size,
)
from brats_swap.augment import RECIPES as NNUNET_RECIPES
from brats_swap.data.challenges import get_challenge
from brats_swap.model.targets import targets_from_labels

# The 48 symmetries of a cube (the full octahedral group with reflections): 6 axis permutations x 8 flips.
# Ellis's `generate_permutation_keys` enumerates the same group as rotate/transpose/flip combinations.
CUBE_SYMMETRIES: tuple[tuple[tuple[int, int, int], tuple[bool, bool, bool]], ...] = tuple(
    (perm, flips)  # type: ignore[misc]
    for perm in itertools.permutations(range(3))
    for flips in itertools.product((False, True), repeat=3)
)


@dataclass(frozen=True)
class CubeSymmetry:
    """One sample's cube48 draw: permute the spatial axes by `perm`, then flip the axes marked in `flips`."""

    perm: tuple[int, int, int]
    flips: tuple[bool, bool, bool]


@dataclass(frozen=True)
class MonaiSeed:
    """One sample's mild draw: the seed MONAI's random transforms are set to before they run on it."""

    seed: int


def allowed_symmetries(shape: Sequence[int]) -> list[tuple[tuple[int, int, int], tuple[bool, bool, bool]]]:
    """Symmetries that keep the array shape: an axis permutation may only swap axes of equal size."""
    return [(perm, flips) for perm, flips in CUBE_SYMMETRIES if all(shape[p] == shape[i] for i, p in enumerate(perm))]


def apply_symmetry(tensor: torch.Tensor, perm: Sequence[int], flips: Sequence[bool]) -> torch.Tensor:
    """Permute then flip the last three (spatial) axes of `tensor`; leading axes (channels) are kept."""
    lead = tensor.dim() - 3
    moved = tensor.permute(*range(lead), *(lead + p for p in perm))
    flip_axes = [lead + i for i, f in enumerate(flips) if f]
    return (moved.flip(flip_axes) if flip_axes else moved).contiguous()


def worker_crop_size(recipe: str, sample_size: Sequence[int], patch_mode: bool) -> tuple[int, int, int]:
    """What a worker crops for one sample of `sample_size` (the patch or the cube): the nnU-Net recipes in
    patch mode crop nnU-Net's enlarged patch (`get_patch_size`); everything else the sample itself."""
    if patch_mode and recipe in NNUNET_RECIPES:
        return tuple(int(v) for v in enlarged_crop_size(recipe, tuple(sample_size)))  # type: ignore[return-value]
    return tuple(int(v) for v in sample_size)  # type: ignore[return-value]


def draw_params(recipe: str, rng: np.random.Generator, sample_size: Sequence[int], channels: int) -> Any:
    """One sample's augmentation parameters (picklable, they travel with the batch), drawn from `rng`."""
    if recipe == "cube48":
        options = allowed_symmetries(sample_size)
        perm, flips = options[int(rng.integers(len(options)))]
        return CubeSymmetry(perm, flips)
    if recipe == "mild":
        return MonaiSeed(int(rng.integers(2**31 - 1)))
    if recipe in NNUNET_RECIPES:
        return draw_sample_augment(recipe, rng, tuple(sample_size), channels)
    return None


def build_monai_augment():
    """Mild intensity and spatial augmentations (MONAI dictionary transforms), applied jointly to image+label."""
    from monai.transforms import (  # imported where used: MONAI takes seconds to import
        Compose,
        RandAffined,
        RandGaussianNoised,
        RandScaleIntensityd,
        RandShiftIntensityd,
    )

    return Compose([
        RandAffined(keys=["image", "label"], prob=0.2, rotate_range=(0.26, 0.26, 0.26), scale_range=(0.1, 0.1, 0.1),
                    mode=("bilinear", "nearest"), padding_mode="zeros"),
        RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
        RandGaussianNoised(keys="image", prob=0.15, std=0.1),
    ])


def arrived_batch_bytes(recipe: str, batch: int, channels: int, sample_size: Sequence[int], patch_mode: bool) -> int:
    """Bytes of one batch as the loader hands it over (and as it lands on the device): float16 images and
    uint8 labels, each sample the crop its worker reads (`worker_crop_size`)."""
    return batch * int(np.prod(worker_crop_size(recipe, sample_size, patch_mode))) * (channels * 2 + 1)


def augment_buffers(recipe: str, batch: int, channels: int, sample_size: Sequence[int], num_labels: int,
                    patch_mode: bool) -> int:
    """Device bytes the augmentation of one batch holds at its peak besides the float32 batch it returns: the
    float16 batch as it arrived and the recipe's own buffers (sampling grids, label channels). All of it is
    freed before the forward starts (`DeviceBatches.prepare` returns only the augmented batch)."""
    crop = worker_crop_size(recipe, sample_size, patch_mode)
    voxels = int(np.prod(crop))
    arrived = arrived_batch_bytes(recipe, batch, channels, sample_size, patch_mode)
    if recipe in NNUNET_RECIPES:
        return arrived + int(augment_buffer_bytes(batch, channels, tuple(sample_size), num_labels, crop))
    # cube48, mild, none: a float32 copy of the batch and its int64 labels while they are permuted or transformed
    return arrived + batch * voxels * (channels * 4 + 8)


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
                 sample_size: Sequence[int]) -> None:
        self.recipe, self.device = recipe, device
        self.edition, self.outputs, self.regions = edition, outputs, tuple(regions)
        self.sample_size = tuple(int(v) for v in sample_size)
        self.label_values = (0, *get_challenge(edition).label_values)  # background included
        self.monai = build_monai_augment() if recipe == "mild" else None

    def prepare(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(images float32 (B, C, *sample), targets float32 (B, outputs, *sample)) on the device."""
        images = batch["image"].to(self.device, non_blocking=True).float()
        labels = batch["label"].to(self.device, non_blocking=True).long()
        if any(pad is not None for pad in batch["pad"]):
            images, labels = restore_windows(images, labels, batch["pad"])
        images, labels = self.augment(images, labels, batch["augment"])
        targets = targets_from_labels(labels, self.edition, self.outputs, self.regions).float()
        return images, targets

    def augment(self, images: torch.Tensor, labels: torch.Tensor, params: Sequence[Any]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recipe == "cube48":
            pairs = [(apply_symmetry(image, p.perm, p.flips), apply_symmetry(label, p.perm, p.flips))
                     for image, label, p in zip(images, labels, params, strict=True)]
            return torch.stack([image for image, _ in pairs]), torch.stack([label for _, label in pairs])
        if self.recipe == "mild":
            return self._monai(images, labels, params)
        if self.recipe in NNUNET_RECIPES:
            # nnU-Net marks the background voxels outside the brain (zero in every channel: the cache's
            # z-scored modalities are 0 there, and so is an enlarged crop past the volume) with -1, never a
            # tumour voxel; the transforms zero the image there and return the labels with -1 turned into 0.
            labels = labels.masked_fill((images == 0).all(dim=1) & (labels == 0), OUTSIDE_LABEL)
            return augment_batch(images, labels, params, self.sample_size, self.label_values)
        return images, labels

    def _monai(self, images: torch.Tensor, labels: torch.Tensor, params: Sequence[MonaiSeed]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """MONAI's transforms work sample by sample; each starts from its sample's seed."""
        out_images, out_labels = [], []
        for image, label, drawn in zip(images, labels, params, strict=True):
            self.monai.set_random_state(seed=drawn.seed)
            out = self.monai({"image": image, "label": label[None].float()})
            out_images.append(torch.as_tensor(out["image"]).float())
            out_labels.append(torch.round(torch.as_tensor(out["label"])[0]).long())
        return torch.stack(out_images), torch.stack(out_labels)
