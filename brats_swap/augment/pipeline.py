"""`augment_batch`: an nnU-Net recipe applied to a whole batch on its own device, and `augment_buffer_bytes`,
the device memory it needs on top of its inputs.

The pipeline is the spatial transform (it makes the patch) followed by the recipe's steps (`Recipe.steps`, in
nnU-Net's order), each in place. Both functions take the steps themselves, so the byte bound is derived from
the very steps `augment_batch` runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from brats_swap.augment import spatial
from brats_swap.augment.recipes import SampleAugment
from brats_swap.augment.spatial import BACKGROUND, OUTSIDE_LABEL
from brats_swap.augment.steps import Step


def _check(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
           patch_size: Sequence[int], label_values: Sequence[int], steps: Sequence[Step]) -> None:
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
    names = tuple(step.name for step in steps)
    for p in params:
        if p.channels != images.shape[1]:
            raise ValueError(f"augment_batch: parameters drawn for {p.channels} channels, "
                             f"the images have {images.shape[1]}")
        if tuple(name for name, _ in p.steps) != names:
            raise ValueError(f"augment_batch: parameters drawn for the steps {[n for n, _ in p.steps]}, "
                             f"the recipe runs {list(names)}")


def _resample_or_crop(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
                      patch_size: Sequence[int], label_values: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The spatial transform: one grid_sample for every sample that resamples; a centre crop for the others."""
    resampled = [b for b, p in enumerate(params) if p.spatial.resamples]
    cropped = [b for b, p in enumerate(params) if not p.spatial.resamples]
    out_images = images.new_empty((images.shape[0], images.shape[1], *patch_size))
    out_labels = labels.new_empty((labels.shape[0], *patch_size))
    if cropped:
        # cropping first is a view of the batch: only the patches are gathered. Where the patch is larger than
        # the input, the image is padded with 0 and the labels with -1 (outside the input).
        out_images[cropped] = spatial.centre_crop(images, patch_size)[cropped]
        out_labels[cropped] = spatial.centre_crop(labels, patch_size, OUTSIDE_LABEL)[cropped]
    if resampled:
        grid = spatial.sampling_grid([params[b].spatial for b in resampled], [params[b].seed for b in resampled],
                                     patch_size, images.shape[2:], images.device)
        values = sorted({OUTSIDE_LABEL, *label_values})
        out_images[resampled], out_labels[resampled] = spatial.resample(images, labels, resampled, grid, values)
    return out_images, out_labels


def augment_batch(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
                  patch_size: Sequence[int], label_values: Sequence[int], *, steps: Sequence[Step]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Augment a batch on its device with the recipe's `steps` after the spatial transform (`params` drawn by
    that recipe); see the package docstring. Returns new tensors (B, C, *patch_size) and (B, *patch_size),
    labels with -1 turned into 0 by the recipe's mask step; the inputs are not modified."""
    _check(images, labels, params, patch_size, label_values, steps)
    patch_size = tuple(int(s) for s in patch_size)
    out_images, out_labels = _resample_or_crop(images, labels, params, patch_size, label_values)
    seeds = [p.seed for p in params]
    for i, step in enumerate(steps):
        step.apply(out_images, out_labels, [p.steps[i][1] for p in params], seeds)
    return out_images, out_labels


def augment_buffer_bytes(batch: int, channels: int, patch_size: Sequence[int], num_labels: int,
                         input_size: Sequence[int], *, steps: Sequence[Step], element_bytes: int = 4,
                         label_bytes: int = 8) -> int:
    """A bound of the device bytes augment_batch allocates beyond its inputs at its peak, for the planner:
    the outputs, which live throughout, plus the largest of the spatial transform's phases
    (`spatial.buffer_bytes`) and the peaks of the recipe's `steps` (each step's `buffer_bytes`).
    `num_labels` counts the label values other than -1 (BraTS: 4)."""
    patch = math.prod(int(s) for s in patch_size)
    outputs = batch * patch * (channels * element_bytes + label_bytes)
    spatial_peak = spatial.buffer_bytes(batch, channels, patch_size, num_labels, input_size, element_bytes,
                                        label_bytes)
    steps_peak = max((step.buffer_bytes(batch, channels, patch, element_bytes) for step in steps), default=0)
    return outputs + max(spatial_peak, steps_peak)
