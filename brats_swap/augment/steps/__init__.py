"""The transforms of the nnU-Net recipes after the spatial transform, one module each, and what they share.

A step (`Step`) is its own parameters, a frozen dataclass (the recipe's probabilities and ranges for it), with
a `name` and these methods: `draw`, the sample's value drawn on the host in the loader's worker from the
sample's numpy Generator (picklable: plain numbers and small tuples; `neutral` is the value that changes
nothing); `apply`, the value of every sample of the batch applied in place on the device; and `buffer_bytes`,
what `apply` holds at its peak beyond the batch. The step and its parameters are one object, so a recipe's
tuple of steps is also the tuple of their parameters. A recipe (`brats_swap.augment.recipes.Recipe`) is an ordered
tuple of steps after its spatial parameters; `augment_batch` runs exactly those and the byte bound is the
largest of exactly those, so adding a transform is one module here and one line in the recipe's tuple.

The batched kernels live in the one step that uses them; this module holds what several share: the
(sample, channel) pairs a per-channel value chooses (worked out on the host, so choosing never waits for the
device), the batch seen as (B * C, X, Y, Z) channels, and the byte count of image-sized temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from brats_swap.augment.ranges import BGContrastRange, UniformRange, draw_per_channel


class Step(Protocol):
    """One in-place transform of the augmented batch: images (B, C, *patch) float, labels (B, *patch) int64."""

    @property
    def name(self) -> str:
        """The step's name in a recipe (unique within it); a sample's drawn value is found by it."""

    def neutral(self, channels: int) -> Any:
        """The value that changes nothing."""

    def draw(self, rng: np.random.Generator, channels: int) -> Any:
        """One sample's value (picklable), from `rng` alone."""

    def apply(self, images: torch.Tensor, labels: torch.Tensor, values: Sequence[Any],
              seeds: Sequence[int]) -> None:
        """Apply every sample's value in place; `seeds` are the samples' seeds (for random fields)."""

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        """A bound of the device bytes `apply` holds at its peak beyond the batch."""


def temporaries_bytes(batch: int, channels: int, patch_voxels: int, element_bytes: int, image_copies: int = 0,
                      voxel_bytes: int = 0) -> int:
    """`image_copies` temporaries the size of the batch's images (gathered channels, intermediate results)
    and `voxel_bytes` per voxel of the batch (a mask)."""
    return batch * patch_voxels * (image_copies * channels * element_bytes + voxel_bytes)


def chosen_channels(values: Sequence[Sequence], neutral) -> tuple[list[int], list]:
    """Flat (sample * C + channel) indices of the per-sample, per-channel `values` that are not `neutral`,
    and those values."""
    index, chosen = [], []
    for b, row in enumerate(values):
        for c, value in enumerate(row):
            if value != neutral:
                index.append(b * len(row) + c)
                chosen.append(value)
    return index, chosen


def column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-channel values as a (n, 1, 1, 1) tensor on `like`'s device and dtype."""
    return torch.tensor(values, device=like.device, dtype=like.dtype).view(-1, 1, 1, 1)


def channel_view(images: torch.Tensor) -> torch.Tensor:
    """The batch (B, C, X, Y, Z) as B * C channels (X, Y, Z), a view: writing it writes the batch."""
    return images.view(-1, *images.shape[2:])


def per_channel_tensor(values: Sequence[Sequence[float]], like: torch.Tensor) -> torch.Tensor:
    """Per-sample, per-channel values as a (B, C, 1, 1, 1) tensor on `like`'s device and dtype."""
    return torch.tensor(values, device=like.device, dtype=like.dtype)[..., None, None, None]


class FactorPerChannel:
    """The draw of a step whose value is one number per channel, 1 where not applied (brightness, contrast,
    low resolution, gamma): it fires with `p`, then on each channel with `p_per_channel`, each chosen channel
    drawing its number from `range`. The steps using it are frozen dataclasses with those three fields."""

    p: float
    p_per_channel: float
    range: UniformRange | BGContrastRange

    def neutral(self, channels: int) -> tuple[float, ...]:
        return (1.0,) * channels

    def draw(self, rng: np.random.Generator, channels: int) -> tuple[float, ...]:
        return draw_per_channel(rng, self.p, self.p_per_channel, self.range, channels, 1.0)

    def chosen(self, values: Sequence[Sequence[float]]) -> tuple[list[int], list]:
        """The (sample * C + channel) indices the values apply to, and those values."""
        return chosen_channels(values, 1.0)
