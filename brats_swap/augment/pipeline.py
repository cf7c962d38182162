"""`augment_batch`: nnU-Net's training augmentation applied to a whole batch on its own device, and
`augment_buffer_bytes`, the device memory it needs on top of its inputs.

The pipeline is the spatial transform (it makes the patch) followed by `STEPS`, the in-place transforms in
nnU-Net's order. Each step declares what it allocates at its peak, so the byte bound is derived from the very
steps `augment_batch` runs: a new step is one entry here (and its function and parity test).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from brats_swap.augment import intensity, spatial
from brats_swap.augment.recipes import SampleAugment

# nnU-Net marks voxels outside the brain mask with this label (its data loader writes it where the
# nonzero mask is false, and since nnunetv2 2.7 its spatial transform fills space outside the input with it);
# the image is zeroed there (MaskImageTransform) and it becomes background.
OUTSIDE_LABEL = -1
BACKGROUND = 0


@dataclass(frozen=True)
class Step:
    """One in-place transform of the augmented batch (images (B, C, *patch), labels (B, *patch)) and the
    device bytes it holds at its peak beyond them: `image_copies` temporaries the size of the batch's images
    (the gathered channels and the intermediate results) and `voxel_bytes` per voxel of the batch (a mask)."""

    name: str
    apply: Callable[[torch.Tensor, torch.Tensor, Sequence[SampleAugment]], None]
    image_copies: int = 0
    voxel_bytes: int = 0

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        return batch * patch_voxels * (self.image_copies * channels * element_bytes + self.voxel_bytes)


def _noise(images, labels, params) -> None:
    intensity.add_noise(images, [p.noise_std for p in params],
                        [spatial.field_seed(p.seed, spatial.NOISE_SEED_OFFSET) for p in params])


def _blur(images, labels, params) -> None:
    intensity.blur(images, *intensity.chosen_channels([p.blur_sigmas for p in params], (0.0, 0.0, 0.0)))


def _brightness(images, labels, params) -> None:
    intensity.multiply(images, [p.brightness for p in params])


def _contrast(images, labels, params) -> None:
    intensity.contrast(images, *intensity.chosen_channels([p.contrast for p in params], 1.0))


def _low_resolution(images, labels, params) -> None:
    intensity.low_resolution(images, *intensity.chosen_channels([p.low_resolution for p in params], 1.0))


def _gamma_inverted(images, labels, params) -> None:
    intensity.gamma(images, *intensity.chosen_channels([p.gamma_inverted for p in params], 1.0), invert=True)


def _additive_brightness(images, labels, params) -> None:
    intensity.add(images, [p.additive_brightness for p in params])


def _gamma(images, labels, params) -> None:
    intensity.gamma(images, *intensity.chosen_channels([p.gamma for p in params], 1.0), invert=False)


def _mirror(images, labels, params) -> None:
    for axis in range(3):
        flipped = [b for b, p in enumerate(params) if p.mirror[axis]]
        if flipped:
            images[flipped] = images[flipped].flip(axis + 2)
            labels[flipped] = labels[flipped].flip(axis + 1)


def _mask_outside(images, labels, params) -> None:
    """nnU-Net's MaskImageTransform (every channel) and RemoveLabelTansform(-1, 0)."""
    outside = labels == OUTSIDE_LABEL
    images.masked_fill_(outside[:, None], 0.0)
    labels.masked_fill_(outside, BACKGROUND)


# nnU-Net's order after the spatial transform (nnUNetTrainer.get_training_transforms). The copies: one
# sample's noise image; blur's gathered channels, their padded copy and the convolution's output (and its
# kernel); contrast and the gammas hold the gathered channels and up to four temporaries of their size; low
# resolution one channel at a time; mirroring the gathered samples and their flipped copy; the mask a bool.
STEPS: tuple[Step, ...] = (
    Step("noise", _noise, image_copies=1),
    Step("blur", _blur, image_copies=4),
    Step("brightness", _brightness),
    Step("contrast", _contrast, image_copies=5),
    Step("low_resolution", _low_resolution, image_copies=1),
    Step("gamma_inverted", _gamma_inverted, image_copies=5),
    Step("additive_brightness", _additive_brightness),
    Step("gamma", _gamma, image_copies=5),
    Step("mirror", _mirror, image_copies=2),
    Step("mask_outside", _mask_outside, voxel_bytes=1),
)


def _check(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
           patch_size: Sequence[int], label_values: Sequence[int], pad_label: int) -> None:
    if not images.is_floating_point():
        raise ValueError(f"augment_batch: images are {images.dtype}, not floating point")
    if images.ndim != 5 or labels.shape != (images.shape[0], *images.shape[2:]):
        raise ValueError(f"augment_batch: images {tuple(images.shape)} and labels {tuple(labels.shape)} "
                         "must be (B, C, X, Y, Z) and (B, X, Y, Z)")
    if len(params) != images.shape[0]:
        raise ValueError(f"augment_batch: {len(params)} parameter sets for a batch of {images.shape[0]}")
    if len(patch_size) != 3:
        raise ValueError(f"augment_batch: patch size {tuple(patch_size)} is not 3D")
    if BACKGROUND not in label_values:
        raise ValueError(f"augment_batch: label values {tuple(label_values)} must include the background 0")
    if pad_label not in (BACKGROUND, OUTSIDE_LABEL):
        raise ValueError(f"augment_batch: padding label {pad_label} is neither 0 nor -1")
    for p in params:
        if len(p.brightness) != images.shape[1]:
            raise ValueError(f"augment_batch: parameters drawn for {len(p.brightness)} channels, "
                             f"the images have {images.shape[1]}")


def _resample_or_crop(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
                      patch_size: Sequence[int], label_values: Sequence[int], pad_label: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The spatial transform: one grid_sample for every sample that resamples; a centre crop for the others."""
    resampled = [b for b, p in enumerate(params) if p.resamples]
    cropped = [b for b, p in enumerate(params) if not p.resamples]
    out_images = images.new_empty((images.shape[0], images.shape[1], *patch_size))
    out_labels = labels.new_empty((labels.shape[0], *patch_size))
    if cropped:
        # cropping first is a view of the batch: only the patches are gathered. Where the patch is larger than
        # the input, the image is padded with 0 and the labels with the padding label.
        out_images[cropped] = spatial.centre_crop(images, patch_size)[cropped]
        out_labels[cropped] = spatial.centre_crop(labels, patch_size, pad_label)[cropped]
    if resampled:
        grid = spatial.sampling_grid([params[b] for b in resampled], patch_size, images.shape[2:],
                                     images.device)
        values = sorted({OUTSIDE_LABEL, *label_values})
        out_images[resampled], out_labels[resampled] = spatial.resample(images, labels, resampled, grid,
                                                                        values, pad_label)
    return out_images, out_labels


def augment_batch(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
                  patch_size: Sequence[int], label_values: Sequence[int], *, pad_label: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Augment a batch on its device; see the package docstring. `pad_label` fills space outside the input
    (the recipe's `Recipe.pad_label`). Returns new tensors (B, C, *patch_size) and (B, *patch_size), labels
    with -1 turned into 0; the inputs are not modified."""
    _check(images, labels, params, patch_size, label_values, pad_label)
    patch_size = tuple(int(s) for s in patch_size)
    out_images, out_labels = _resample_or_crop(images, labels, params, patch_size, label_values, pad_label)
    for step in STEPS:
        step.apply(out_images, out_labels, params)
    return out_images, out_labels


def augment_buffer_bytes(batch: int, channels: int, patch_size: Sequence[int], num_labels: int,
                         input_size: Sequence[int], element_bytes: int = 4, label_bytes: int = 8) -> int:
    """A bound of the device bytes augment_batch allocates beyond its inputs at its peak, for the planner:
    the outputs, which live throughout, plus the largest of the spatial transform's phases
    (`spatial.buffer_bytes`) and the steps' peaks (`Step.buffer_bytes`). `num_labels` counts the label values
    other than -1 (BraTS: 4)."""
    patch = math.prod(int(s) for s in patch_size)
    outputs = batch * patch * (channels * element_bytes + label_bytes)
    spatial_peak = spatial.buffer_bytes(batch, channels, patch_size, num_labels, input_size, element_bytes,
                                        label_bytes)
    steps_peak = max(step.buffer_bytes(batch, channels, patch, element_bytes) for step in STEPS)
    return outputs + max(spatial_peak, steps_peak)
