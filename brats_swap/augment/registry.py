"""The augmentation recipes `train.augment` names: one registry, one protocol.

A recipe is one object (`AugmentRecipe`): the crop a loader worker reads for a sample, the sample's
parameters drawn there from its own generator, their application to the whole batch on the training device,
and the device bytes that application holds, derived from the same steps it runs. The names below are the
only list of recipes: the config loader checks `train.augment` against `RECIPE_NAMES`, and the training
pipeline takes the object from `get_recipe`.

This module imports only the standard library (the config checks names without importing torch); a recipe's
module is imported when the recipe is first asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch


class AugmentRecipe(Protocol):
    """What the training pipeline asks of a recipe (the sample size is the patch, or the cube in
    whole-volume training)."""

    def crop_size(self, sample_size: Sequence[int], patch_mode: bool) -> tuple[int, int, int]:
        """The block a worker reads around a sample: the sample itself, or an enlarged crop."""

    def draw(self, rng: np.random.Generator, sample_size: tuple[int, int, int], channels: int) -> Any:
        """One sample's parameters (picklable: they travel with the batch), from `rng` alone."""

    def apply(self, images: torch.Tensor, labels: torch.Tensor, params: Sequence[Any],
              sample_size: tuple[int, int, int], label_values: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch augmented on its device: images (B, C, *crop) float32 and labels (B, *crop) int64 in,
        (B, C, *sample_size) and (B, *sample_size) out; `label_values` are the labels' values, 0 included."""

    def buffer_bytes(self, batch: int, channels: int, sample_size: Sequence[int], num_labels: int,
                     crop: Sequence[int]) -> int:
        """A bound of the device bytes `apply` allocates at its peak beyond its inputs, outputs included."""


# name -> (module of brats_swap.augment, the recipe object in it). The one place a recipe is named.
_HOMES: dict[str, tuple[str, str]] = {
    "cube48": ("cube", "CUBE48"),  # the 48 rotations/reflections of the cube (Isensee 2017 as Ellis trained it)
    "nnunet": ("nnunet", "NNUNET_V2"),  # nnunetv2 2.8.1's get_training_transforms
    "nnunet_brats2020": ("nnunet", "NNUNET_BRATS2020"),  # the stronger set of nnU-Net's BraTS 2020 entry
    "mild": ("mild", "MILD"),  # a light MONAI set
    "none": ("cube", "NONE"),
}
RECIPE_NAMES: tuple[str, ...] = tuple(_HOMES)


def get_recipe(name: str) -> AugmentRecipe:
    if name not in _HOMES:
        raise ValueError(f"augment recipe {name!r}: not one of {', '.join(RECIPE_NAMES)}")
    module, attribute = _HOMES[name]
    return getattr(importlib.import_module(f"brats_swap.augment.{module}"), attribute)
