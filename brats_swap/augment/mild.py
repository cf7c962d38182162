"""The `mild` recipe: a light MONAI set (small affine, intensity scale and shift, noise), run by MONAI on the
device's tensors, sample by sample from the sample's seed. A CPU recipe (docs/augmentation.md): MONAI draws its
Gaussian noise with NumPy on the host at the sample's full size, in the training process, so on a GPU it
puts host work and a copy on every step's path."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from brats_swap.augment.cube import PlainRecipe


@dataclass(frozen=True)
class MonaiSeed:
    """One sample's mild draw: the seed MONAI's random transforms are set to before they run on it."""

    seed: int


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


class Mild(PlainRecipe):
    @functools.cached_property
    def transforms(self):
        return build_monai_augment()

    def draw(self, rng: np.random.Generator, sample_size, channels) -> MonaiSeed:
        return MonaiSeed(int(rng.integers(2**31 - 1)))

    def apply(self, images, labels, params, sample_size, label_values):
        """MONAI's transforms work sample by sample; each starts from its sample's seed."""
        out_images, out_labels = [], []
        for image, label, drawn in zip(images, labels, params, strict=True):
            self.transforms.set_random_state(seed=drawn.seed)
            out = self.transforms({"image": image, "label": label[None].float()})
            out_images.append(torch.as_tensor(out["image"]).float())
            out_labels.append(torch.round(torch.as_tensor(out["label"])[0]).long())
        return torch.stack(out_images), torch.stack(out_labels)


MILD = Mild()
