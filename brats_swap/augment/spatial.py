"""The spatial transform, batched: rotation, scaling and elastic deformation as one sampling grid per sample,
and one `grid_sample` for every sample of the batch that draws any of them (the others are only cropped).

Semantics are batchgeneratorsv2's `SpatialTransform` with `random_crop=False` (nnU-Net's setting): the patch
is centred on the input, the grid is the centred identity grid of the patch in voxels, displaced by the
elastic offsets, then multiplied by the affine `Rz @ Ry @ Rx @ S`; with an elastic deformation the grid's mean
is moved back to the centre. Images are sampled linearly with zero padding; each label is sampled linearly as
an indicator and the label with the largest score wins (nnU-Net's `bg_style_seg_sampling=False` path); outside
the input counts as `OUTSIDE_LABEL` -1, in both nnU-Net recipes: nnunetv2 2.8.1's `border_mode_seg='constant',
padding_value_seg=-1`, and nnU-Net v1's get_insaneDA_augmentation2 (the BraTS 2020 entry's pipeline,
nnunet/training/data_augmentation/data_augmentation_insaneDA2.py: `border_mode_seg="constant",
border_cval_seg=border_val_seg`, default `border_val_seg=-1`), so the mask step zeroes the image there.
Scores are kept in float32 and an exact
tie goes to the first label (-1, then the others in increasing order), where batchgeneratorsv2
0.3.6 rounds them to float16 and gives ties to the nearest neighbour's label: the two agree on all but a few
boundary voxels (>= 99.9%, tests/test_augment_faithful.py).

A recipe's spatial parameters (`SpatialParams`) are drawn here too (`SpatialParams.draw`, into
`SpatialValues`), and so is the crop a loader reads for them (`enlarged_crop_size`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from brats_swap.augment.ranges import BGContrastRange, UniformRange, draw_scalar

# nnU-Net marks voxels outside the brain mask with this label (its data loader writes it where the
# nonzero mask is false, and its spatial transform fills space outside the input with it); the image is zeroed
# there (steps/mask_outside.py, MaskImageTransform) and it becomes background.
OUTSIDE_LABEL = -1
BACKGROUND = 0

# nnU-Net sizes the enlarged crop with the scale range (0.85, 1.25) whatever the recipe's scaling (its
# configure_rotation_dummyDA_mirroring_and_inital_patch_size says so; v1's DA3 computed it before widening its
# scale range too).
_CROP_SCALE_MIN = 0.85


@dataclass(frozen=True)
class SpatialValues:
    """One sample's drawn spatial transform. Neutral values mean "not applied": rotation 0, scaling 1,
    elastic magnitude 0."""

    rotation: tuple[float, float, float]  # radians about axes 0, 1, 2
    scaling: tuple[float, float, float]  # > 1 shrinks objects (samples a larger region)
    elastic_sigmas: tuple[float, float, float]  # voxels: smoothing of the displacement noise
    elastic_magnitudes: tuple[float, float, float]  # voxels: largest displacement per axis; 0 = none

    @property
    def resamples(self) -> bool:
        """Whether the spatial transform resamples (rotation, scaling or elastic); otherwise a plain crop."""
        return (any(a != 0.0 for a in self.rotation) or any(s != 1.0 for s in self.scaling)
                or any(m != 0.0 for m in self.elastic_magnitudes))


NO_SPATIAL = SpatialValues((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


@dataclass(frozen=True)
class SpatialParams:
    """A recipe's spatial transform: probabilities (`p_*`) and ranges, named after the batchgeneratorsv2
    SpatialTransform arguments they set."""

    p_rotation: float
    rotation: UniformRange
    p_scaling: float
    scaling: UniformRange | BGContrastRange
    p_synchronize_scaling_across_axes: float
    p_elastic_deform: float
    elastic_deform_scale: UniformRange  # sigma of the smoothing, as a fraction of the patch edge

    def draw(self, rng: np.random.Generator, patch_size: tuple[int, int, int]) -> SpatialValues:
        do_rotation = rng.random() < self.p_rotation
        do_scaling = rng.random() < self.p_scaling
        do_elastic = rng.random() < self.p_elastic_deform
        rotation = tuple(draw_scalar(rng, self.rotation) for _ in range(3)) if do_rotation else (0.0, 0.0, 0.0)
        scaling = (1.0, 1.0, 1.0)
        if do_scaling:
            if rng.random() <= self.p_synchronize_scaling_across_axes:
                scaling = (draw_scalar(rng, self.scaling),) * 3
            else:
                scaling = tuple(draw_scalar(rng, self.scaling) for _ in range(3))
        sigmas, magnitudes = (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)
        if do_elastic:
            scale = draw_scalar(rng, self.elastic_deform_scale)  # one deformation scale for all axes
            sigmas = tuple(scale * size for size in patch_size)
            magnitudes = tuple(float(rng.uniform(s / 8, s / 2)) for s in sigmas)
        return SpatialValues(rotation, scaling, sigmas, magnitudes)  # type: ignore[arg-type]


def rotation_matrix(angle: float, axis: int) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    if axis == 0:
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    if axis == 1:
        return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def enlarged_crop_size(params: SpatialParams, patch_size: tuple[int, int, int]) -> tuple[int, int, int]:
    """nnU-Net's `get_patch_size`: the crop the loader takes so the rotated and scaled patch rarely reaches
    past it (128^3 -> 205^3). The patch's diagonal vector is rotated by the largest angle about each axis in
    turn, the largest extent per axis kept, divided by the smallest scale 0.85 and truncated."""
    extent = np.array(patch_size, dtype=float)
    largest = max(abs(params.rotation.low), abs(params.rotation.high)) if params.p_rotation > 0 else 0.0
    angle = min(largest, math.pi / 2)
    shape = extent.copy()
    for axis in range(3):
        # batchgenerators' rotate_coords_3d multiplies the row vector by the rotation matrix.
        shape = np.maximum(shape, np.abs(extent @ rotation_matrix(angle, axis)))
    shape = shape / _CROP_SCALE_MIN
    return tuple(int(s) for s in shape)  # type: ignore[return-value]


def affine_matrix(rotation: Sequence[float], scaling: Sequence[float]) -> torch.Tensor:
    """batchgeneratorsv2's create_affine_matrix_3d: Rz @ Ry @ Rx @ diag(scaling), float64."""
    rx, ry, rz = (torch.from_numpy(rotation_matrix(a, axis)) for axis, a in enumerate(rotation))
    return rz @ ry @ rx @ torch.diag(torch.tensor(list(scaling), dtype=torch.float64))


def centred_grid(patch_size: Sequence[int], device: torch.device) -> torch.Tensor:
    """(X, Y, Z, 3) voxel coordinates of the patch relative to its centre."""
    axes = [torch.linspace((1 - s) / 2, (s - 1) / 2, s, device=device) for s in patch_size]
    return torch.stack(torch.meshgrid(axes, indexing="ij"), -1)


def _gaussian_transfer(size: int, sigma: float, device: torch.device) -> torch.Tensor:
    # scipy.ndimage.fourier_gaussian's factor per frequency index k: exp(-2 pi^2 sigma^2 k^2 / n^2).
    k = torch.fft.fftfreq(size, device=device, dtype=torch.float64)
    return torch.exp(-2.0 * math.pi**2 * sigma**2 * k**2)


def elastic_offsets(noise: torch.Tensor, sigmas: Sequence[float], magnitudes: Sequence[float]) -> torch.Tensor:
    """The displacement field from standard normal `noise` (3, X, Y, Z): each axis's component smoothed with
    a Gaussian of `sigmas[d]` voxels in the Fourier domain and scaled so its largest |value| is
    `magnitudes[d]` voxels (batchgeneratorsv2's elastic branch). Returns (X, Y, Z, 3)."""
    out = torch.empty_like(noise)
    for d in range(3):
        spectrum = torch.fft.fftn(noise[d].double())
        for axis, size in enumerate(noise.shape[1:]):
            shape = [1, 1, 1]
            shape[axis] = size
            spectrum = spectrum * _gaussian_transfer(size, sigmas[d], noise.device).view(shape)
        smooth = torch.fft.ifftn(spectrum).real.to(noise.dtype)
        largest = smooth.abs().max()
        out[d] = smooth / (largest / max(magnitudes[d], 1e-8))
    return out.permute(1, 2, 3, 0)


def elastic_noise(seed: int, patch_size: Sequence[int], device: torch.device) -> torch.Tensor:
    """The standard normal field an elastic deformation smooths, drawn from the sample's seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((3, *patch_size), generator=generator, device=device)


# Offsets of the seeds of a sample's random fields, so each field has a stream of its own.
NOISE_SEED_OFFSET = 1
ELASTIC_SEED_OFFSET = 2


def field_seed(seed: int, offset: int) -> int:
    return (seed + offset) % (2**63 - 1)


def sampling_grid(values: Sequence[SpatialValues], seeds: Sequence[int], patch_size: Sequence[int],
                  input_size: Sequence[int], device: torch.device) -> torch.Tensor:
    """(n, X, Y, Z, 3) grid_sample grid (align_corners=False) of the given samples (their spatial values and
    seeds), centred on the input."""
    base = centred_grid(patch_size, device)
    grids = []
    for p, seed in zip(values, seeds, strict=True):
        grid = base
        elastic = any(m != 0.0 for m in p.elastic_magnitudes)
        if elastic:
            noise = elastic_noise(field_seed(seed, ELASTIC_SEED_OFFSET), patch_size, device)
            grid = grid + elastic_offsets(noise, p.elastic_sigmas, p.elastic_magnitudes)
        # Grid points are row vectors: multiplying by A^T applies A to each of them.
        grid = grid @ affine_matrix(p.rotation, p.scaling).T.to(device=device, dtype=grid.dtype)
        if elastic:
            grid = grid - grid.mean(dim=(0, 1, 2))
        grids.append(grid)
    grid = torch.stack(grids)
    half = torch.tensor([s / 2 for s in input_size], device=device, dtype=grid.dtype)
    # grid_sample reads the last coordinate as the first spatial axis.
    return (grid / half).flip(-1)


def centre_crop(volume: torch.Tensor, patch_size: Sequence[int], pad_value: float = 0) -> torch.Tensor:
    """batchgeneratorsv2's crop_tensor at the input's centre (floor of half the size), padding with
    `pad_value` where the patch is larger than the input; `volume` is (..., X, Y, Z)."""
    spatial = volume.shape[-3:]
    slices, pads = [], []
    for size, patch in zip(spatial, patch_size, strict=True):
        start = size // 2 - patch // 2
        lo, hi = max(start, 0), min(start + patch, size)
        slices.append(slice(lo, hi))
        pads.append((lo - start, patch - (hi - start)))
    cropped = volume[(..., *slices)]
    if any(a or b for a, b in pads):
        cropped = F.pad(cropped, [v for pair in reversed(pads) for v in pair], value=pad_value)
    return cropped


def resample(images: torch.Tensor, labels: torch.Tensor, chosen: Sequence[int], grid: torch.Tensor,
             label_values: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample images (B, C, ...) and labels (B, ...) of the `chosen` samples at `grid` in one grid_sample.

    Each label other than `OUTSIDE_LABEL` is sampled as a linear indicator next to the image channels,
    in one stacked input built sample by sample (no second copy of the images); the outside label's score is
    one minus the others' (grid_sample is linear and the indicators partition the padded volume, so that
    equals sampling its indicator padded with ones). The highest score wins, the first label on a tie.
    `label_values` must hold every value the labels hold.
    """
    channels = images.shape[1]
    others = [v for v in label_values if v != OUTSIDE_LABEL]
    stacked = images.new_empty((len(chosen), channels + len(others), *images.shape[2:]))
    for i, b in enumerate(chosen):
        stacked[i, :channels] = images[b]
        for j, value in enumerate(others):
            torch.eq(labels[b], value, out=stacked[i, channels + j])
    sampled = F.grid_sample(stacked, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    del stacked
    scores = sampled[:, channels:]
    outside_score = 1.0 - scores.sum(1, keepdim=True)
    ordered = torch.tensor([OUTSIDE_LABEL, *others], device=labels.device, dtype=labels.dtype)
    winner = torch.cat([outside_score, scores], 1).argmax(1)
    return sampled[:, :channels], ordered[winner]


def buffer_bytes(batch: int, channels: int, patch_size: Sequence[int], num_labels: int,
                 input_size: Sequence[int], element_bytes: int = 4, label_bytes: int = 8) -> int:
    """A bound of what the spatial transform holds at its peak besides its outputs: the largest of building
    the grids (one sample's elastic field at a time), resampling and choosing labels. `num_labels` counts the
    label values other than -1: that many indicators (-1's is one minus their sum) are sampled next to the
    image channels."""
    patch = math.prod(int(s) for s in patch_size)
    full = math.prod(int(s) for s in input_size)
    coordinates = 3 * 4  # a float32 grid point
    grids = patch * coordinates * (1 + 2 * batch)  # the centred base grid, the batch's grid and its normalised copy
    # the grids built so far, and one sample's elastic field: its noise (3 float32 fields), two complex128
    # spectra, the smoothed component in float64 and float32, the offsets and three grid temporaries
    elastic = batch * patch * coordinates + patch * (coordinates + 2 * 16 + 8 + 4 + coordinates + 3 * coordinates)
    sampled_channels = channels + num_labels
    # the stacked input of image channels and label indicators at input size, and their sampled patch
    resampling = grids + batch * sampled_channels * (full + patch) * element_bytes
    # the sampled patch, the scores with the padding label's (and its sum), the argmax and the chosen labels
    labelling = grids + batch * patch * (sampled_channels * element_bytes + (num_labels + 2) * element_bytes
                                         + 2 * label_bytes)
    return max(elastic, resampling, labelling)
