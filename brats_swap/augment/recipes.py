"""The nnU-Net recipes' tables (`Recipe`: probabilities, ranges, the padding label) and the per-sample
parameters drawn from them (`SampleAugment`).

`draw_from_recipe` draws one sample's parameters from a table with the sample's numpy Generator, in the
loader's worker, so every draw follows the sample's seed (exact resume, ranks differ). The draws reproduce
batchgeneratorsv2's `get_parameters` distributions transform by transform (tests/test_augment_draws.py
compares them over thousands of draws). The recipes themselves, by name, are `brats_swap.augment.registry`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

# The rotation range nnU-Net v2 uses for 3D patches that are not "dummy 2D" (all of BraTS's):
# nnUNetTrainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size, (-30 deg, 30 deg).
_THIRTY_DEGREES = 30.0 / 360.0 * 2.0 * math.pi


@dataclass(frozen=True)
class BGContrastRange:
    """batchgeneratorsv2's `BGContrast` draw: half the time U(low, 1), otherwise U(max(low, 1), high), so a
    factor below one is as likely as one above it however lopsided the range is."""

    low: float
    high: float


@dataclass(frozen=True)
class UniformRange:
    low: float
    high: float


@dataclass(frozen=True)
class Recipe:
    """One recipe's probabilities (`p_*`) and ranges, named after the batchgeneratorsv2 arguments they set."""

    p_rotation: float
    rotation: UniformRange
    p_scaling: float
    scaling: UniformRange | BGContrastRange
    p_synchronize_scaling_across_axes: float
    p_elastic_deform: float
    elastic_deform_scale: UniformRange  # sigma of the smoothing, as a fraction of the patch edge
    p_noise: float
    noise_std: UniformRange
    p_blur: float
    p_blur_per_channel: float
    blur_sigma: UniformRange
    blur_synchronize_axes: bool
    p_brightness: float
    brightness: UniformRange | BGContrastRange
    p_contrast: float
    contrast: BGContrastRange
    p_low_resolution: float
    p_low_resolution_per_channel: float
    low_resolution_scale: UniformRange
    p_gamma_inverted: float
    p_gamma: float
    gamma: BGContrastRange
    p_additive_brightness: float
    additive_brightness_sigma: float  # N(0, sigma) per channel
    p_mirror_per_axis: float
    # The label the spatial transform gives space outside its input (the image there is 0): -1, nnU-Net's
    # "outside the brain", which the mask step then zeroes in every channel; or 0, background.
    pad_label: int


# nnU-Net v2's defaults as of nnunetv2 2.8.1: nnUNetTrainer.get_training_transforms (MIC-DKFZ/nnUNet,
# nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py) with the 3D rotation range above. Since 2.7 its
# SpatialTransform pads the segmentation with -1 (border_mode_seg='constant', padding_value_seg=-1).
NNUNET = Recipe(
    p_rotation=0.2, rotation=UniformRange(-_THIRTY_DEGREES, _THIRTY_DEGREES),
    p_scaling=0.2, scaling=UniformRange(0.7, 1.4), p_synchronize_scaling_across_axes=1.0,
    p_elastic_deform=0.0, elastic_deform_scale=UniformRange(0.0, 0.0),
    p_noise=0.1, noise_std=UniformRange(0.0, 0.1),  # `noise_variance=(0, 0.1)`, used as the std by the code
    p_blur=0.2, p_blur_per_channel=0.5, blur_sigma=UniformRange(0.5, 1.0), blur_synchronize_axes=False,
    p_brightness=0.15, brightness=BGContrastRange(0.75, 1.25),
    p_contrast=0.15, contrast=BGContrastRange(0.75, 1.25),
    p_low_resolution=0.25, p_low_resolution_per_channel=0.5, low_resolution_scale=UniformRange(0.5, 1.0),
    p_gamma_inverted=0.1, p_gamma=0.3, gamma=BGContrastRange(0.7, 1.5),
    p_additive_brightness=0.0, additive_brightness_sigma=0.0,
    p_mirror_per_axis=0.5,
    pad_label=-1,
)

# nnU-Net's BraTS 2020 entry (Isensee et al., "nnU-Net for Brain Tumor Segmentation", arXiv 2011.00848; the
# changes are listed in MIC-DKFZ/nnUNet issue #2568). Its trainers (nnU-Net v1,
# nnunet/training/network_training/competitions_with_custom_Trainers/BraTS2020/
# nnUNetTrainerV2BraTSRegions_moreDA.py, `nnUNetTrainerV2BraTSRegions_DA3_BN`) take their parameters from
# nnUNetTrainerV2_DA3.setup_DA_params and the pipeline from data_augmentation_insaneDA2.get_insaneDA_augmentation2.
# Those are written here with batchgeneratorsv2's semantics (the v2 transform of each v1 one):
# - spatial: rotation +-30 deg per axis p 0.3; scaling p 0.3 in (0.65, 1.6), drawn below/above one half the time
#   each as v1's augment_spatial_2 does, one factor per axis with p 0.3 (`p_independent_scale_per_axis`);
#   elastic deformation p 0.3, deformation scale U(0, 0.25) of the patch for all axes, magnitude U(sigma/8,
#   sigma/2) per axis (augment_spatial_2's rule);
# - noise p 0.15; blur p 0.2, sigma U(0.5, 1.5) the same on all axes, each channel 0.5; multiplicative
#   brightness U(0.7, 1.3) p 0.15; contrast (0.65, 1.5) p 0.15 keeping the range; low resolution p 0.25, each
#   channel 0.5, scale U(0.5, 1) (v1 upsampled cubic, v2 trilinear: v2's is used); inverted gamma p 0.15;
#   additive brightness N(0, 0.2) per channel p 0.3; gamma p 0.3; both gammas in (0.5, 1.6) keeping mean and std;
# - outside the input the labels are background 0 (batchgeneratorsv2's default zeros padding, as this recipe
#   always did).
NNUNET_BRATS2020 = dataclasses.replace(
    NNUNET,
    p_rotation=0.3, p_scaling=0.3, scaling=BGContrastRange(0.65, 1.6), p_synchronize_scaling_across_axes=0.7,
    p_elastic_deform=0.3, elastic_deform_scale=UniformRange(0.0, 0.25),
    p_noise=0.15, blur_sigma=UniformRange(0.5, 1.5), blur_synchronize_axes=True,
    brightness=UniformRange(0.7, 1.3), contrast=BGContrastRange(0.65, 1.5),
    p_gamma_inverted=0.15, gamma=BGContrastRange(0.5, 1.6),
    p_additive_brightness=0.3, additive_brightness_sigma=0.2,
    pad_label=0,
)

# nnU-Net sizes the enlarged crop with the scale range (0.85, 1.25) whatever the recipe's scaling (its
# configure_rotation_dummyDA_mirroring_and_inital_patch_size says so; v1's DA3 computed it before widening its
# scale range too).
_CROP_SCALE_MIN = 0.85


@dataclass(frozen=True)
class SampleAugment:
    """One sample's drawn augmentation: plain numbers and small tuples (picklable, cheap to collate).

    Neutral values mean "not applied": rotation 0, scaling 1, elastic magnitude 0, noise std 0, blur sigmas
    (0, 0, 0), multipliers and gammas 1, additive shift 0. A drawn factor is never exactly neutral except with
    probability ~2**-53. `seed` seeds the device's torch.Generator for the full-size random fields (the noise
    image, the elastic displacement), so augment_batch is a function of these parameters alone.
    """

    seed: int
    rotation: tuple[float, float, float]  # radians about axes 0, 1, 2
    scaling: tuple[float, float, float]  # > 1 shrinks objects (samples a larger region)
    elastic_sigmas: tuple[float, float, float]  # voxels: smoothing of the displacement noise
    elastic_magnitudes: tuple[float, float, float]  # voxels: largest displacement per axis; 0 = none
    noise_std: float
    blur_sigmas: tuple[tuple[float, float, float], ...]  # per channel, per axis
    brightness: tuple[float, ...]  # per channel multipliers
    contrast: tuple[float, ...]  # per channel factors around the channel mean, range kept
    low_resolution: tuple[float, ...]  # per channel down-scaling factors
    gamma_inverted: tuple[float, ...]  # per channel gamma of the inverted image, mean and std kept
    additive_brightness: tuple[float, ...]  # per channel shifts
    gamma: tuple[float, ...]  # per channel gamma, mean and std kept
    mirror: tuple[bool, bool, bool]

    @property
    def resamples(self) -> bool:
        """Whether the spatial transform resamples (rotation, scaling or elastic); otherwise a plain crop."""
        return (any(a != 0.0 for a in self.rotation) or any(s != 1.0 for s in self.scaling)
                or any(m != 0.0 for m in self.elastic_magnitudes))


def _draw(rng: np.random.Generator, spec: UniformRange | BGContrastRange) -> float:
    if isinstance(spec, BGContrastRange):
        if rng.random() < 0.5 and spec.low < 1:
            return float(rng.uniform(spec.low, 1.0))
        return float(rng.uniform(max(spec.low, 1.0), spec.high))
    return float(rng.uniform(spec.low, spec.high))


def _draw_spatial(rng: np.random.Generator, r: Recipe, patch_size: tuple[int, int, int]) -> dict:
    do_rotation = rng.random() < r.p_rotation
    do_scaling = rng.random() < r.p_scaling
    do_elastic = rng.random() < r.p_elastic_deform
    rotation = tuple(_draw(rng, r.rotation) for _ in range(3)) if do_rotation else (0.0, 0.0, 0.0)
    scaling = (1.0, 1.0, 1.0)
    if do_scaling:
        if rng.random() <= r.p_synchronize_scaling_across_axes:
            scaling = (_draw(rng, r.scaling),) * 3
        else:
            scaling = tuple(_draw(rng, r.scaling) for _ in range(3))
    sigmas, magnitudes = (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)
    if do_elastic:
        scale = _draw(rng, r.elastic_deform_scale)  # one deformation scale for all axes
        sigmas = tuple(scale * size for size in patch_size)
        magnitudes = tuple(float(rng.uniform(s / 8, s / 2)) for s in sigmas)
    return {"rotation": rotation, "scaling": scaling, "elastic_sigmas": sigmas,
            "elastic_magnitudes": magnitudes}


def _per_channel(rng: np.random.Generator, p: float, p_channel: float, spec, channels: int,
                 neutral: float) -> tuple[float, ...]:
    """A transform that fires with p, then on each channel with p_channel, one draw per chosen channel."""
    if not rng.random() < p:
        return (neutral,) * channels
    chosen = rng.random(channels) < p_channel
    return tuple(_draw(rng, spec) if use else neutral for use in chosen)


def _blur(rng: np.random.Generator, r: Recipe, channels: int) -> tuple[tuple[float, float, float], ...]:
    none = (0.0, 0.0, 0.0)
    if not rng.random() < r.p_blur:
        return (none,) * channels
    chosen = rng.random(channels) < r.p_blur_per_channel
    sigmas = []
    for use in chosen:
        if not use:
            sigmas.append(none)
        elif r.blur_synchronize_axes:
            sigmas.append((_draw(rng, r.blur_sigma),) * 3)
        else:
            sigmas.append(tuple(_draw(rng, r.blur_sigma) for _ in range(3)))
    return tuple(sigmas)


def draw_from_recipe(r: Recipe, rng: np.random.Generator, patch_size: tuple[int, int, int],
                     channels: int) -> SampleAugment:
    """Draw one sample's parameters from a recipe table, in the order of nnU-Net's pipeline."""
    patch_size = tuple(int(s) for s in patch_size)
    seed = int(rng.integers(0, 2**63 - 1))
    spatial = _draw_spatial(rng, r, patch_size)
    noise_std = _draw(rng, r.noise_std) if rng.random() < r.p_noise else 0.0
    blur = _blur(rng, r, channels)
    brightness = _per_channel(rng, r.p_brightness, 1.0, r.brightness, channels, 1.0)
    contrast = _per_channel(rng, r.p_contrast, 1.0, r.contrast, channels, 1.0)
    low_resolution = _per_channel(rng, r.p_low_resolution, r.p_low_resolution_per_channel,
                                  r.low_resolution_scale, channels, 1.0)
    gamma_inverted = _per_channel(rng, r.p_gamma_inverted, 1.0, r.gamma, channels, 1.0)
    additive = (0.0,) * channels
    if rng.random() < r.p_additive_brightness:
        additive = tuple(float(v) for v in rng.normal(0.0, r.additive_brightness_sigma, channels))
    gamma = _per_channel(rng, r.p_gamma, 1.0, r.gamma, channels, 1.0)
    mirror = tuple(bool(m) for m in rng.random(3) < r.p_mirror_per_axis)
    return SampleAugment(seed=seed, **spatial, noise_std=noise_std, blur_sigmas=blur, brightness=brightness,
                         contrast=contrast, low_resolution=low_resolution, gamma_inverted=gamma_inverted,
                         additive_brightness=additive, gamma=gamma, mirror=mirror)


def rotation_matrix(angle: float, axis: int) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    if axis == 0:
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    if axis == 1:
        return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def enlarged_crop_size(r: Recipe, patch_size: tuple[int, int, int]) -> tuple[int, int, int]:
    """nnU-Net's `get_patch_size`: the crop the loader takes so the rotated and scaled patch rarely reaches
    past it (128^3 -> 205^3). The patch's diagonal vector is rotated by the largest angle about each axis in
    turn, the largest extent per axis kept, divided by the smallest scale 0.85 and truncated."""
    extent = np.array(patch_size, dtype=float)
    largest = max(abs(r.rotation.low), abs(r.rotation.high)) if r.p_rotation > 0 else 0.0
    angle = min(largest, math.pi / 2)
    shape = extent.copy()
    for axis in range(3):
        # batchgenerators' rotate_coords_3d multiplies the row vector by the rotation matrix.
        shape = np.maximum(shape, np.abs(extent @ rotation_matrix(angle, axis)))
    shape = shape / _CROP_SCALE_MIN
    return tuple(int(s) for s in shape)
