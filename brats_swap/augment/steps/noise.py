"""Gaussian noise (batchgeneratorsv2's GaussianNoiseTransform, synchronize_channels=True): with p, one std per
sample for all channels, the noise image drawn on the device from the sample's seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from brats_swap.augment.ranges import UniformRange, draw_scalar
from brats_swap.augment.spatial import NOISE_SEED_OFFSET, field_seed
from brats_swap.augment.steps import temporaries_bytes


def add_noise(images: torch.Tensor, stds: Sequence[float], seeds: Sequence[int]) -> None:
    """Per sample, one std for all channels (synchronize_channels=True); the noise image comes from the
    sample's own generator on the images' device, drawn as batchgeneratorsv2 draws it (normal_(0, std) over
    (C, X, Y, Z))."""
    for b, (std, seed) in enumerate(zip(stds, seeds, strict=True)):
        if std == 0.0:
            continue
        generator = torch.Generator(device=images.device).manual_seed(seed)
        noise = torch.empty(images.shape[1:], device=images.device, dtype=images.dtype)
        images[b] += noise.normal_(0.0, std, generator=generator)


@dataclass(frozen=True)
class Noise:
    """Value: the sample's noise std, one for all channels; 0 = no noise."""

    p: float
    std: UniformRange  # nnU-Net's `noise_variance`, used as the std by batchgeneratorsv2's code
    name: ClassVar[str] = "noise"

    def neutral(self, channels: int) -> float:
        return 0.0

    def draw(self, rng: np.random.Generator, channels: int) -> float:
        return draw_scalar(rng, self.std) if rng.random() < self.p else 0.0

    def apply(self, images, labels, values: Sequence[float], seeds: Sequence[int]) -> None:
        add_noise(images, values, [field_seed(seed, NOISE_SEED_OFFSET) for seed in seeds])

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # one sample's noise image at a time
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=1)
