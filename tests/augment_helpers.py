"""Shared by tests/test_augment_*.py: small test volumes, neutral parameters, and nnU-Net's transforms built
from batchgeneratorsv2: nnunetv2 2.8.1's SpatialTransform argument for argument, the others with the
parameters of brats_swap.augment's recipes."""

from __future__ import annotations

import math

import numpy as np
import torch

from brats_swap.augment.ranges import BGContrastRange
from brats_swap.augment.recipes import NNUNET, Recipe, SampleAugment
from brats_swap.augment.spatial import NO_SPATIAL

LABEL_VALUES = (0, 1, 2, 3)


def volume(channels: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth multi-channel image (values about N(0, 1)) and labels: a brain ball (-1 outside it) holding
    nested tumour blobs 1, 2, 3, so labels meet along curved boundaries."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn((1, channels, 6, 6, 6), generator=g)
    image = torch.nn.functional.interpolate(coarse, (size,) * 3, mode="trilinear", align_corners=True)[0]
    image = image + 0.1 * torch.randn((channels, size, size, size), generator=g)
    axis = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    radius = torch.sqrt(x**2 + y**2 + z**2)
    off = torch.sqrt((x - size * 0.1) ** 2 + (y + size * 0.05) ** 2 + z**2)
    labels = torch.zeros((size,) * 3, dtype=torch.int64)
    labels[off < size * 0.3] = 2
    labels[off < size * 0.2] = 1
    labels[(off < size * 0.1) | ((x > 0) & (off < size * 0.25) & (z > 2))] = 3
    labels[radius > size * 0.45] = -1
    return image.float(), labels


def neutral(channels: int, seed: int = 0, steps=NNUNET.steps, **values) -> SampleAugment:
    """Parameters for `steps` (a recipe's) that change nothing, with `values` (step names, spatial fields)
    replaced."""
    base = SampleAugment(seed=seed, channels=channels, spatial=NO_SPATIAL,
                         steps=tuple((step.name, step.neutral(channels)) for step in steps))
    return base.with_values(**values)


def angles_and_scales(affine: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Invert batchgeneratorsv2's create_affine_matrix_3d (Rz @ Ry @ Rx @ S, angles within +-90 deg)."""
    scales = np.linalg.norm(affine, axis=0)
    r = affine / scales
    b = -math.asin(r[2, 0])
    a = math.atan2(r[2, 1], r[2, 2])
    c = math.atan2(r[1, 0], r[0, 0])
    return (a, b, c), tuple(float(s) for s in scales)


def bg_range(spec):
    """A recipe range as batchgeneratorsv2's RandomScalar."""
    from batchgeneratorsv2.transforms.intensity.contrast import BGContrast

    if isinstance(spec, BGContrastRange):
        return BGContrast((spec.low, spec.high))
    return (spec.low, spec.high)


def elastic_magnitude(image=None, patch_size=None, dim=None, deformation_scale=None, **_):
    """v1's augment_spatial_2 rule as a batchgeneratorsv2 magnitude: U(sigma / 8, sigma / 2) voxels."""
    sigma = deformation_scale * patch_size[dim]
    return np.random.uniform(sigma / 8, sigma / 2)


# nnunetv2's rotation_for_DA for 3D patches that are not "dummy 2D" (configure_rotation_dummyDA_mirroring_and_
# inital_patch_size): +-30 degrees.
NNUNET_3D_ROTATION = (-30.0 / 360 * 2.0 * np.pi, 30.0 / 360 * 2.0 * np.pi)


def nnunet_spatial_transform(patch_size, **overrides):
    """nnunetv2 2.8.1's SpatialTransform exactly as nnUNetTrainer.get_training_transforms builds it (3D),
    `overrides` replacing arguments to force a draw."""
    from batchgeneratorsv2.transforms.spatial.spatial import SpatialTransform

    kwargs = dict(
        patch_center_dist_from_border=0, random_crop=False, p_elastic_deform=0,
        p_rotation=0.2,
        rotation=NNUNET_3D_ROTATION, p_scaling=0.2, scaling=(0.7, 1.4), p_synchronize_scaling_across_axes=1,
        bg_style_seg_sampling=False,
        border_mode_seg='constant',
        padding_value_seg=-1,
    )
    kwargs.update(overrides)
    return SpatialTransform(tuple(patch_size), **kwargs)


def spatial_transform(recipe: Recipe, patch_size, **overrides):
    """The recipe's SpatialTransform: nnU-Net v2's own for NNUNET, else one built from the recipe's values
    (space outside the input labelled -1, as nnU-Net v1's get_insaneDA_augmentation2 pads it too)."""
    if recipe is NNUNET:
        return nnunet_spatial_transform(patch_size, **overrides)
    from batchgeneratorsv2.transforms.spatial.spatial import SpatialTransform

    r = recipe.spatial
    kwargs = dict(
        patch_center_dist_from_border=0, random_crop=False, p_elastic_deform=r.p_elastic_deform,
        elastic_deform_scale=bg_range(r.elastic_deform_scale), elastic_deform_magnitude=elastic_magnitude,
        p_synchronize_def_scale_across_axes=1, p_rotation=r.p_rotation, rotation=bg_range(r.rotation),
        p_scaling=r.p_scaling, scaling=bg_range(r.scaling),
        p_synchronize_scaling_across_axes=r.p_synchronize_scaling_across_axes, bg_style_seg_sampling=False,
        border_mode_seg="constant", padding_value_seg=-1)
    kwargs.update(overrides)
    return SpatialTransform(tuple(patch_size), **kwargs)


def intensity_transforms(recipe: Recipe) -> dict:
    """step name -> (apply probability, batchgeneratorsv2 transform), nnU-Net's pipeline with the recipe's
    values."""
    from batchgeneratorsv2.transforms.intensity.brightness import (
        BrightnessAdditiveTransform,
        MultiplicativeBrightnessTransform,
    )
    from batchgeneratorsv2.transforms.intensity.contrast import ContrastTransform
    from batchgeneratorsv2.transforms.intensity.gamma import GammaTransform
    from batchgeneratorsv2.transforms.intensity.gaussian_noise import GaussianNoiseTransform
    from batchgeneratorsv2.transforms.noise.gaussian_blur import GaussianBlurTransform
    from batchgeneratorsv2.transforms.spatial.low_resolution import SimulateLowResolutionTransform

    noise, blur, brightness, contrast, low_resolution, gamma_inverted, additive, gamma = (
        recipe.step(name) for name in ("noise", "blur", "brightness", "contrast", "low_resolution",
                                       "gamma_inverted", "additive_brightness", "gamma"))
    transforms = {
        "noise": (noise.p, GaussianNoiseTransform(noise_variance=bg_range(noise.std), p_per_channel=1,
                                                  synchronize_channels=True)),
        "blur": (blur.p, GaussianBlurTransform(blur_sigma=bg_range(blur.sigma), synchronize_channels=False,
                                               synchronize_axes=blur.synchronize_axes,
                                               p_per_channel=blur.p_per_channel, benchmark=False)),
        "brightness": (brightness.p, MultiplicativeBrightnessTransform(
            multiplier_range=bg_range(brightness.range), synchronize_channels=False, p_per_channel=1)),
        "contrast": (contrast.p, ContrastTransform(contrast_range=bg_range(contrast.range), preserve_range=True,
                                                   synchronize_channels=False, p_per_channel=1)),
        "low_resolution": (low_resolution.p, SimulateLowResolutionTransform(
            scale=bg_range(low_resolution.range), synchronize_channels=False, synchronize_axes=True,
            ignore_axes=None, allowed_channels=None, p_per_channel=low_resolution.p_per_channel)),
        "gamma_inverted": (gamma_inverted.p, GammaTransform(gamma=bg_range(gamma_inverted.range), p_invert_image=1,
                                                            synchronize_channels=False, p_per_channel=1,
                                                            p_retain_stats=1)),
        "additive_brightness": (additive.p, BrightnessAdditiveTransform(
            mu=0.0, sigma=additive.sigma, synchronize_channels=False, p_per_channel=1)),
        "gamma": (gamma.p, GammaTransform(gamma=bg_range(gamma.range), p_invert_image=0,
                                          synchronize_channels=False, p_per_channel=1, p_retain_stats=1)),
    }
    # nnU-Net v2's pipeline has no additive brightness
    return {name: t for name, t in transforms.items() if t[0] > 0}


def intensity_fields(name: str, params: dict, channels: int) -> dict:
    """batchgeneratorsv2's parameters of one intensity transform as {step name: value}."""
    def per_channel(indices, values, neutral_value):
        out = [neutral_value] * channels
        for c, v in zip(torch.as_tensor(indices).tolist(), values, strict=True):
            out[c] = v
        return tuple(out)

    if name == "noise":
        return {"noise": float(params["sigmas"])}
    if name == "blur":
        chosen = torch.nonzero(params["apply_to_channel"]).flatten().tolist()
        return {"blur": per_channel(chosen, [tuple(map(float, s)) for s in params["sigmas"]],
                                    (0.0, 0.0, 0.0))}
    if name == "low_resolution":
        scales = params["scales"][:, 0].tolist() if len(params["apply_to_channel"]) else []
        return {name: per_channel(params["apply_to_channel"], scales, 1.0)}
    if name == "additive_brightness":
        idx = params["apply_to_channel"]
        return {name: per_channel(idx, params["shift"][idx].tolist(), 0.0)}
    key = {"brightness": "multipliers", "contrast": "multipliers", "gamma_inverted": "gamma",
           "gamma": "gamma"}[name]
    return {name: per_channel(params["apply_to_channel"], params[key].tolist(), 1.0)}
