"""brats_swap.augment equals batchgeneratorsv2, nnU-Net's own augmentation library, transform by transform:
given the parameters batchgeneratorsv2's `get_parameters` drew, `augment_batch` with the same parameters
(and nothing else) gives its output followed by nnU-Net's MaskImageTransform and RemoveLabelTransform(-1, 0).
The nnunet recipe's reference is nnunetv2 2.8.1's SpatialTransform argument for argument (space outside the
input labelled -1); nnunet_brats2020's one built with its values, space outside labelled -1 too (nnU-Net v1's
get_insaneDA_augmentation2). Intensity transforms within 1e-5; spatial ones within interpolation rounding, labels on
>= 99.9% of voxels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from augment_helpers import (
    LABEL_VALUES,
    angles_and_scales,
    intensity_fields,
    intensity_transforms,
    neutral,
    spatial_transform,
    volume,
)
from batchgeneratorsv2.transforms.spatial.mirroring import MirrorTransform
from batchgeneratorsv2.transforms.utils.nnunet_masking import MaskImageTransform
from batchgeneratorsv2.transforms.utils.remove_label import RemoveLabelTransform

from brats_swap.augment import get_recipe
from brats_swap.augment.pipeline import augment_batch
from brats_swap.augment.recipes import NNUNET, NNUNET_BRATS2020
from brats_swap.augment.spatial import ELASTIC_SEED_OFFSET, NOISE_SEED_OFFSET, field_seed

CHANNELS = 2
PATCH = (32, 32, 32)


def _reference(image: torch.Tensor, labels: torch.Tensor, transforms_and_params) -> dict:
    """batchgeneratorsv2: the given transforms with their parameters, then mask and -1 -> 0."""
    data = {"image": image.clone(), "segmentation": labels[None].clone()}
    for transform, params, before in transforms_and_params:
        if before is not None:
            before()
        data = transform.apply(data, **params)
    data = MaskImageTransform(apply_to_channels=list(range(CHANNELS)), channel_idx_in_seg=0).apply(data)
    return RemoveLabelTransform(-1, 0).apply(data)


def _ours(image, labels, params, recipe=NNUNET):
    images, out_labels = augment_batch(image[None], labels[None], [params], PATCH, LABEL_VALUES,
                                       steps=recipe.steps)
    return images[0], out_labels[0]


def _spatial_case(recipe, seed, size=40, **overrides):
    """batchgeneratorsv2's SpatialTransform parameters, drawn with the recipe's values and `overrides`,
    as (transform, params, recorded elastic draws)."""
    recorded = {}

    def scale(**_):
        recorded["scale"] = float(np.random.uniform(recipe.spatial.elastic_deform_scale.low,
                                                    recipe.spatial.elastic_deform_scale.high))
        return recorded["scale"]

    def magnitude(patch_size=None, dim=None, deformation_scale=None, **_):
        sigma = deformation_scale * patch_size[dim]
        recorded.setdefault("magnitudes", []).append(float(np.random.uniform(sigma / 8, sigma / 2)))
        return recorded["magnitudes"][-1]

    transform = spatial_transform(recipe, PATCH, elastic_deform_scale=scale, elastic_deform_magnitude=magnitude,
                                  **overrides)
    image, _ = volume(CHANNELS, size, seed)
    np.random.seed(seed)
    torch.manual_seed(field_seed(seed, ELASTIC_SEED_OFFSET))  # the elastic noise field's stream
    params = transform.get_parameters(image=image)
    return transform, params, recorded


def _our_spatial(params, recorded, seed, recipe=NNUNET):
    fields = {}
    if params["affine"] is not None:
        rotation, scaling = angles_and_scales(params["affine"])
        fields.update(rotation=rotation, scaling=scaling)
    if params["elastic_offsets"] is not None:
        fields.update(elastic_sigmas=tuple(recorded["scale"] * s for s in PATCH),
                      elastic_magnitudes=tuple(recorded["magnitudes"]))
    return neutral(CHANNELS, seed=seed, steps=recipe.steps, **fields)


def _assert_spatial_match(reference, ours):
    """Images within 1e-4 except where the two label samplings put a boundary voxel on different sides of
    the brain mask (one side masked to exactly 0), labels equal on >= 99.9% of voxels."""
    image, labels = ours
    assert image.shape == (CHANNELS, *PATCH) and labels.shape == PATCH
    differ = (image - reference["image"]).abs() > 1e-4
    masked_on_one_side = (image == 0) | (reference["image"] == 0)
    assert not (differ & ~masked_on_one_side).any(), (image - reference["image"]).abs()[~masked_on_one_side].max()
    assert differ.float().mean().item() <= 0.001
    agreement = (labels == reference["segmentation"][0].long()).float().mean().item()
    assert agreement >= 0.999, agreement


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotation_and_scaling_match(seed):
    transform, params, recorded = _spatial_case(NNUNET, seed, p_rotation=1, p_scaling=1)
    image, labels = volume(CHANNELS, 40, seed)
    reference = _reference(image, labels, [(transform, params, None)])
    ours = _ours(image, labels, _our_spatial(params, recorded, seed))
    _assert_spatial_match(reference, ours)
    # not vacuous: the patch is not the centre crop
    assert not torch.allclose(ours[0], image[:, 4:36, 4:36, 4:36], atol=1e-2)


@pytest.mark.parametrize("seed", [3, 5, 6])  # deformation scales 0.17-0.22 of the patch, up to 2.6 voxels
def test_elastic_deformation_with_per_axis_scaling_matches(seed):
    transform, params, recorded = _spatial_case(NNUNET_BRATS2020, seed, p_elastic_deform=1, p_rotation=1,
                                                p_scaling=1, p_synchronize_scaling_across_axes=0)
    assert params["elastic_offsets"] is not None and recorded["scale"] > 0.15
    image, labels = volume(CHANNELS, 40, seed)
    reference = _reference(image, labels, [(transform, params, None)])
    ours = _ours(image, labels, _our_spatial(params, recorded, seed, NNUNET_BRATS2020), NNUNET_BRATS2020)
    _assert_spatial_match(reference, ours)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_whole_volume_patch_that_reaches_outside_is_padded_alike(seed):
    """Input = patch (whole-volume training): a rotated, shrunk patch reaches past the volume, where
    batchgeneratorsv2 samples the image as 0 and the labels as the padding label (-1, then 0)."""
    transform, params, recorded = _spatial_case(NNUNET, seed, size=PATCH[0], p_rotation=1, p_scaling=1,
                                                scaling=(1.3, 1.4))
    image, labels = volume(CHANNELS, PATCH[0], seed)
    labels[labels == -1] = 0  # a brain filling the volume: the padding is what differs from the input
    reference = _reference(image, labels, [(transform, params, None)])
    ours = _ours(image, labels, _our_spatial(params, recorded, seed))
    _assert_spatial_match(reference, ours)
    assert (reference["image"][:, 0, 0, 0] == 0).all() and reference["segmentation"][0, 0, 0, 0] == 0


@pytest.mark.parametrize("name", ["nnunet", "nnunet_brats2020"])
@pytest.mark.parametrize("seed", [0, 1])
def test_whole_volume_space_outside_the_input_is_labelled_minus_one_and_zeroed_as_nnunet_does(seed, name):
    """nnunetv2 2.8.1 (nnunet) or the recipe's own SpatialTransform padding -1 as nnU-Net v1's
    get_insaneDA_augmentation2 does (nnunet_brats2020), with patch = input, zoom-out and rotation forced, then
    a contrast change and noise: where the patch reaches past the volume the labels are -1, and the mask step
    zeroes every channel there after the contrast and the noise moved those zeros. The recipe (through its own
    door, the -1 marking included) gives the same voxels; without its mask step they stay changed."""
    recipe = get_recipe(name).table
    transform, params, recorded = _spatial_case(recipe, seed, size=PATCH[0], p_rotation=1, p_scaling=1,
                                                scaling=(1.3, 1.4), p_elastic_deform=0)
    image, labels = volume(CHANNELS, PATCH[0], seed)
    labels[labels == -1] = 0  # a brain filling the volume: every -1 comes from outside the input
    intensity = intensity_transforms(recipe)
    contrast_params = {"apply_to_channel": torch.tensor([0, 1]), "multipliers": torch.tensor([1.2, 0.8])}
    # GaussianNoiseTransform's parameters for one std on every channel (synchronize_channels=True)
    noise_params = {"apply_idx": torch.arange(CHANNELS), "num_apply": CHANNELS, "sigmas": 0.05}
    noise_seed = field_seed(seed, NOISE_SEED_OFFSET)
    reference = _reference(image, labels, [(transform, params, None),
                                           (intensity["noise"][1], noise_params, lambda: torch.manual_seed(noise_seed)),
                                           (intensity["contrast"][1], contrast_params, None)])
    outside = transform.apply({"image": image.clone(), "segmentation": labels[None].clone()},
                              **params)["segmentation"][0] == -1
    assert outside.float().mean() > 0.1  # the zoom-out reaches well past the volume
    assert (reference["image"][:, outside] == 0).all()
    drawn = _our_spatial(params, recorded, seed, recipe).with_values(noise=0.05, contrast=(1.2, 0.8))
    ours = get_recipe(name).apply(image[None], labels[None], [drawn], PATCH, LABEL_VALUES)
    _assert_spatial_match(reference, (ours[0][0], ours[1][0]))
    assert torch.equal(ours[0][0][:, outside], reference["image"][:, outside])
    without_mask = recipe.steps[:-1]
    assert recipe.steps[-1].name == "mask_outside"
    unmasked = neutral(CHANNELS, seed=seed, steps=without_mask,
                       **{f: getattr(drawn.spatial, f) for f in ("rotation", "scaling")}, noise=0.05,
                       contrast=(1.2, 0.8))
    moved = augment_batch(image[None], labels[None], [unmasked], PATCH, LABEL_VALUES, steps=without_mask)[0][0]
    assert (moved[:, outside] != 0).float().mean() > 0.5


def test_a_sample_that_draws_no_spatial_transform_is_the_same_centre_crop():
    transform, params, _ = _spatial_case(NNUNET, 0, size=39, p_rotation=0, p_scaling=0)
    assert params["grid"] is None
    image, labels = volume(CHANNELS, 39, 3)  # odd input: the crop's rounding matters
    reference = _reference(image, labels, [(transform, params, None)])
    images, out_labels = _ours(image, labels, neutral(CHANNELS))
    assert torch.equal(images, reference["image"])
    assert torch.equal(out_labels, reference["segmentation"][0].long())


def _applies(name, params) -> bool:
    if name == "noise":
        return params["num_apply"] > 0
    if name == "blur":
        return bool(params["apply_to_channel"].any())
    return len(params["apply_to_channel"]) > 0


CASES = [(NNUNET, name) for name in intensity_transforms(NNUNET)] + \
        [(NNUNET_BRATS2020, name) for name in ("blur", "brightness", "contrast", "additive_brightness", "gamma")]


@pytest.mark.parametrize("recipe, name", CASES, ids=[f"{'v2' if r is NNUNET else 'brats2020'}-{n}"
                                                     for r, n in CASES])
def test_each_intensity_transform_matches(recipe, name):
    transform = intensity_transforms(recipe)[name][1]
    image, labels = volume(CHANNELS, PATCH[0], 5)
    matched = 0
    for seed in range(40):
        np.random.seed(seed)
        torch.manual_seed(seed)
        params = transform.get_parameters(image=image)
        if not _applies(name, params):
            continue
        noise_seed = field_seed(seed, NOISE_SEED_OFFSET)
        reference = _reference(image, labels, [(transform, params, lambda s=noise_seed: torch.manual_seed(s))])
        ours, _ = _ours(image, labels, neutral(CHANNELS, seed=seed, steps=recipe.steps,
                                               **intensity_fields(name, params, CHANNELS)), recipe)
        assert (ours - reference["image"]).abs().max() <= 1e-5
        assert not torch.allclose(ours, _reference(image, labels, [])["image"], atol=1e-3)
        matched += 1
        if matched == 2:
            return
    pytest.fail(f"{name}: drew no applying parameters in 40 seeds")


def test_mirroring_matches():
    transform = MirrorTransform(allowed_axes=(0, 1, 2))
    image, labels = volume(CHANNELS, PATCH[0], 6)
    torch.manual_seed(4)
    params = transform.get_parameters(image=image)
    assert len(params["axes"]) >= 1
    reference = _reference(image, labels, [(transform, params, None)])
    mirror = tuple(axis in params["axes"] for axis in range(3))
    images, out_labels = _ours(image, labels, neutral(CHANNELS, mirror=mirror))
    assert torch.equal(images, reference["image"])
    assert torch.equal(out_labels, reference["segmentation"][0].long())


@pytest.mark.parametrize("recipe, seed", [(NNUNET, 0), (NNUNET, 1), (NNUNET_BRATS2020, 0), (NNUNET_BRATS2020, 1)],
                         ids=["v2-0", "v2-1", "brats2020-0", "brats2020-1"])
def test_the_whole_pipeline_matches_when_every_transform_fires(recipe, seed):
    """Spatial, the intensity transforms in order, mirroring, mask: one SampleAugment end to end."""
    spatial_t, spatial_params, recorded = _spatial_case(recipe, seed, p_elastic_deform=0, p_rotation=1,
                                                        p_scaling=1)
    ours = _our_spatial(spatial_params, recorded, seed, recipe)
    fields = {}
    steps = [(spatial_t, spatial_params, None)]
    patch_image = spatial_t.apply({"image": volume(CHANNELS, 40, seed)[0].clone()}, **spatial_params)["image"]
    np.random.seed(100 + seed)
    torch.manual_seed(100 + seed)
    for name, (_, transform) in intensity_transforms(recipe).items():
        params = transform.get_parameters(image=patch_image)
        noise_seed = field_seed(seed, NOISE_SEED_OFFSET)
        steps.append((transform, params, (lambda s=noise_seed: torch.manual_seed(s)) if name == "noise" else None))
        fields.update(intensity_fields(name, params, CHANNELS))
    mirror = MirrorTransform(allowed_axes=(0, 1, 2))
    mirror_params = {"axes": [0, 2]}
    steps.append((mirror, mirror_params, None))
    fields["mirror"] = (True, False, True)
    image, labels = volume(CHANNELS, 40, seed)
    reference = _reference(image, labels, steps)
    _assert_spatial_match(reference, _ours(image, labels, ours.with_values(**fields), recipe))
