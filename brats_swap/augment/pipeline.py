"""`augment_batch`: nnU-Net's training augmentation applied to a whole batch on its own device, and
`augment_buffer_bytes`, the device memory it needs on top of its inputs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from brats_swap.augment import intensity, spatial
from brats_swap.augment.recipes import SampleAugment

# nnU-Net marks voxels outside the brain mask with this label (its data loader writes it where the
# nonzero mask is false); the image is zeroed there (MaskImageTransform) and it becomes background.
OUTSIDE_LABEL = -1


def _check(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
           patch_size: Sequence[int], label_values: Sequence[int]) -> None:
    if not images.is_floating_point():
        raise ValueError(f"augment_batch: images are {images.dtype}, not floating point")
    if images.ndim != 5 or labels.shape != (images.shape[0], *images.shape[2:]):
        raise ValueError(f"augment_batch: images {tuple(images.shape)} and labels {tuple(labels.shape)} "
                         "must be (B, C, X, Y, Z) and (B, X, Y, Z)")
    if len(params) != images.shape[0]:
        raise ValueError(f"augment_batch: {len(params)} parameter sets for a batch of {images.shape[0]}")
    if len(patch_size) != 3:
        raise ValueError(f"augment_batch: patch size {tuple(patch_size)} is not 3D")
    if spatial.PAD_LABEL not in label_values:
        raise ValueError(f"augment_batch: label values {tuple(label_values)} must include the background 0")
    for p in params:
        if len(p.brightness) != images.shape[1]:
            raise ValueError(f"augment_batch: parameters drawn for {len(p.brightness)} channels, "
                             f"the images have {images.shape[1]}")


def _spatial(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
             patch_size: Sequence[int], label_values: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One grid_sample for every sample that resamples; a centre crop for the others."""
    resampled = [b for b, p in enumerate(params) if p.resamples]
    cropped = [b for b, p in enumerate(params) if not p.resamples]
    out_images = images.new_empty((images.shape[0], images.shape[1], *patch_size))
    out_labels = labels.new_empty((labels.shape[0], *patch_size))
    if cropped:
        # cropping first is a view of the batch: only the patches are gathered. centre_crop pads with zeros,
        # and label 0 is the padding label.
        out_images[cropped] = spatial.centre_crop(images, patch_size)[cropped]
        out_labels[cropped] = spatial.centre_crop(labels, patch_size)[cropped]
    if resampled:
        grid = spatial.sampling_grid([params[b] for b in resampled], patch_size, images.shape[2:],
                                     images.device)
        values = sorted({OUTSIDE_LABEL, *label_values})
        out_images[resampled], out_labels[resampled] = spatial.resample(images, labels, resampled, grid,
                                                                        values)
    return out_images, out_labels


def _intensity(images: torch.Tensor, params: Sequence[SampleAugment]) -> None:
    """The intensity transforms in nnU-Net's order, in place."""
    intensity.add_noise(images, [p.noise_std for p in params],
                        [spatial.field_seed(p.seed, spatial.NOISE_SEED_OFFSET) for p in params])
    intensity.blur(images, *intensity.chosen_channels([p.blur_sigmas for p in params], (0.0, 0.0, 0.0)))
    intensity.multiply(images, [p.brightness for p in params])
    intensity.contrast(images, *intensity.chosen_channels([p.contrast for p in params], 1.0))
    intensity.low_resolution(images, *intensity.chosen_channels([p.low_resolution for p in params], 1.0))
    intensity.gamma(images, *intensity.chosen_channels([p.gamma_inverted for p in params], 1.0), invert=True)
    intensity.add(images, [p.additive_brightness for p in params])
    intensity.gamma(images, *intensity.chosen_channels([p.gamma for p in params], 1.0), invert=False)


def _mirror(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment]) -> None:
    for axis in range(3):
        flipped = [b for b, p in enumerate(params) if p.mirror[axis]]
        if flipped:
            images[flipped] = images[flipped].flip(axis + 2)
            labels[flipped] = labels[flipped].flip(axis + 1)


def augment_batch(images: torch.Tensor, labels: torch.Tensor, params: Sequence[SampleAugment],
                  patch_size: Sequence[int], label_values: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Augment a batch on its device; see the package docstring. Returns new tensors (B, C, *patch_size) and
    (B, *patch_size), labels with -1 turned into 0; the inputs are not modified."""
    _check(images, labels, params, patch_size, label_values)
    patch_size = tuple(int(s) for s in patch_size)
    out_images, out_labels = _spatial(images, labels, params, patch_size, label_values)
    _intensity(out_images, params)
    _mirror(out_images, out_labels, params)
    outside = out_labels == OUTSIDE_LABEL
    out_images.masked_fill_(outside[:, None], 0.0)
    out_labels.masked_fill_(outside, 0)
    return out_images, out_labels


def augment_buffer_bytes(batch: int, channels: int, patch_size: Sequence[int], num_labels: int,
                         input_size: Sequence[int], element_bytes: int = 4, label_bytes: int = 8) -> int:
    """A bound of the device bytes augment_batch allocates beyond its inputs at its peak, for the planner.

    The outputs live throughout; on top of them the largest of its phases: building the grids (one
    sample's elastic field at a time: its noise, two complex128 spectra, the smoothed field and grid
    temporaries), resampling (the grid and its normalised copy, the stacked input of image channels and
    label indicators at input size, the sampled patch), choosing labels (the sampled patch, the scores and
    the argmax), and the intensity transforms and mirroring (the gathered channels and up to four
    temporaries of their size). `num_labels` counts the label values other than -1 (BraTS: 4): with -1's
    indicator and without the padding label's, that many indicators are sampled.
    """
    patch = math.prod(int(s) for s in patch_size)
    full = math.prod(int(s) for s in input_size)
    outputs = batch * patch * (channels * element_bytes + label_bytes)
    sampled_channels = channels + num_labels
    grids = patch * 3 * 4 * (1 + 2 * batch)  # the centred base grid, the batch's grid and its normalised copy
    elastic = batch * patch * 3 * 4 + patch * (3 * 4 + 2 * 16 + 8 + 4 + 3 * 4 + 3 * 3 * 4)
    resampling = grids + batch * sampled_channels * (full + patch) * element_bytes
    labelling = grids + batch * patch * (sampled_channels * element_bytes + (num_labels + 2) * element_bytes
                                         + 2 * label_bytes)
    intensity = 5 * batch * channels * patch * element_bytes + batch * patch  # and the -1 mask
    return outputs + max(elastic, resampling, labelling, intensity)
