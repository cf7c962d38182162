"""The nnU-Net recipes' tables (`Recipe`: the spatial parameters, the ordered steps after them, the crop rule)
and the per-sample values drawn from them (`SampleAugment`).

`Recipe.draw` draws one sample's values with the sample's numpy Generator, in the loader's worker, so every
draw follows the sample's seed (exact resume, ranks differ): the seed, the spatial values, then each step's
value in the order the steps run. The draws reproduce batchgeneratorsv2's `get_parameters` distributions
transform by transform (tests/test_augment_draws.py compares them over thousands of draws). The recipes
themselves, by name, are `brats_swap.augment.registry`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from brats_swap.augment.ranges import BGContrastRange, UniformRange
from brats_swap.augment.spatial import SpatialParams, SpatialValues, enlarged_crop_size
from brats_swap.augment.steps import Step
from brats_swap.augment.steps.additive_brightness import AdditiveBrightness
from brats_swap.augment.steps.blur import Blur
from brats_swap.augment.steps.brightness import Brightness
from brats_swap.augment.steps.contrast import Contrast
from brats_swap.augment.steps.gamma import Gamma
from brats_swap.augment.steps.low_resolution import LowResolution
from brats_swap.augment.steps.mask_outside import MaskOutside
from brats_swap.augment.steps.mirror import Mirror
from brats_swap.augment.steps.noise import Noise

# The rotation range nnU-Net v2 uses for 3D patches that are not "dummy 2D" (all of BraTS's):
# nnUNetTrainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size, (-30 deg, 30 deg).
_THIRTY_DEGREES = 30.0 / 360.0 * 2.0 * math.pi


@dataclass(frozen=True)
class SampleAugment:
    """One sample's drawn augmentation: plain numbers and small tuples (picklable, cheap to collate).

    `steps` holds (step name, value) in the recipe's order, each value its step's `draw` (the step's
    `neutral` means "not applied"); `value(name)` reads one. `seed` seeds the device's torch.Generator for the
    full-size random fields (the noise image, the elastic displacement), so augment_batch is a function of
    these values alone. `channels` is the channel count they were drawn for.
    """

    seed: int
    channels: int
    spatial: SpatialValues
    steps: tuple[tuple[str, Any], ...]

    def value(self, name: str) -> Any:
        for step_name, value in self.steps:
            if step_name == name:
                return value
        raise KeyError(f"augment parameters: no step {name!r} (the steps: {', '.join(n for n, _ in self.steps)})")

    def with_values(self, **values: Any) -> SampleAugment:
        """A copy with the named steps' values or spatial values (rotation, scaling, ...) replaced."""
        spatial_fields = {f.name for f in dataclasses.fields(SpatialValues)}
        spatial = {k: v for k, v in values.items() if k in spatial_fields}
        steps = {k: v for k, v in values.items() if k not in spatial_fields}
        unknown = set(steps) - {n for n, _ in self.steps}
        if unknown:
            raise KeyError(f"augment parameters: no step or spatial value {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, spatial=dataclasses.replace(self.spatial, **spatial),
                                   steps=tuple((n, steps.get(n, v)) for n, v in self.steps))


@dataclass(frozen=True)
class Recipe:
    """One nnU-Net recipe: its spatial transform's parameters, the steps after it in the order they run, and
    the crop a loader reads for a patch (`crop`, from the spatial parameters and the patch size)."""

    spatial: SpatialParams
    steps: tuple[Step, ...]
    crop: Callable[[SpatialParams, tuple[int, int, int]], tuple[int, int, int]] = enlarged_crop_size

    def __post_init__(self) -> None:
        names = [step.name for step in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"augment recipe: step names {names} are not unique")
        if not self.steps or not isinstance(self.steps[-1], MaskOutside):
            raise ValueError(f"augment recipe: steps {names} must end with MaskOutside() "
                             "(steps/mask_outside.py), or labels -1 would reach the targets")

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"augment recipe: no step {name!r} (the steps: {', '.join(s.name for s in self.steps)})")

    def with_changes(self, spatial: Mapping[str, Any] | None = None, **steps: Mapping[str, Any]) -> Recipe:
        """A copy with spatial parameters and the named steps' parameters replaced, order kept."""
        unknown = set(steps) - {s.name for s in self.steps}
        if unknown:
            raise KeyError(f"augment recipe: no step {', '.join(sorted(unknown))}")
        return dataclasses.replace(
            self, spatial=dataclasses.replace(self.spatial, **(spatial or {})),
            steps=tuple(dataclasses.replace(s, **steps.get(s.name, {})) for s in self.steps))

    def draw(self, rng: np.random.Generator, patch_size: tuple[int, int, int], channels: int) -> SampleAugment:
        """Draw one sample's values, in the order of nnU-Net's pipeline."""
        patch_size = tuple(int(s) for s in patch_size)  # type: ignore[assignment]
        seed = int(rng.integers(0, 2**63 - 1))
        spatial = self.spatial.draw(rng, patch_size)
        steps = tuple((step.name, step.draw(rng, channels)) for step in self.steps)
        return SampleAugment(seed=seed, channels=channels, spatial=spatial, steps=steps)


# nnU-Net v2's defaults as of nnunetv2 2.8.1: nnUNetTrainer.get_training_transforms (MIC-DKFZ/nnUNet,
# nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py) with the 3D rotation range above. Since 2.7 its
# SpatialTransform pads the segmentation with -1 (border_mode_seg='constant', padding_value_seg=-1).
NNUNET = Recipe(
    spatial=SpatialParams(
        p_rotation=0.2, rotation=UniformRange(-_THIRTY_DEGREES, _THIRTY_DEGREES),
        p_scaling=0.2, scaling=UniformRange(0.7, 1.4), p_synchronize_scaling_across_axes=1.0,
        p_elastic_deform=0.0, elastic_deform_scale=UniformRange(0.0, 0.0)),
    steps=(
        Noise(p=0.1, std=UniformRange(0.0, 0.1)),  # `noise_variance=(0, 0.1)`, used as the std by the code
        Blur(p=0.2, p_per_channel=0.5, sigma=UniformRange(0.5, 1.0), synchronize_axes=False),
        Brightness(p=0.15, range=BGContrastRange(0.75, 1.25)),
        Contrast(p=0.15, range=BGContrastRange(0.75, 1.25)),
        LowResolution(p=0.25, p_per_channel=0.5, range=UniformRange(0.5, 1.0)),
        Gamma(p=0.1, range=BGContrastRange(0.7, 1.5), invert=True),
        # nnU-Net v2's pipeline has no additive brightness: p 0, kept in the tuple because its draw takes one
        # number from the sample's generator, so every later draw is the one earlier runs made (exact resume).
        AdditiveBrightness(p=0.0, sigma=0.0),
        Gamma(p=0.3, range=BGContrastRange(0.7, 1.5), invert=False),
        Mirror(p_per_axis=0.5),
        MaskOutside(),
    ),
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
# - outside the input the labels are -1, then the image is zeroed there and -1 becomes 0, as in the v2 recipe:
#   get_insaneDA_augmentation2 (nnunet/training/data_augmentation/data_augmentation_insaneDA2.py) passes
#   SpatialTransform_2 `border_mode_seg="constant", border_cval_seg=border_val_seg` with its default
#   `border_val_seg=-1` (the trainers above pass none), then MaskTransform(..., set_outside_to=0) and
#   RemoveLabelTransform(-1, 0) (brats_swap.augment.spatial; the last step, steps/mask_outside.py).
_BRATS2020_GAMMA = BGContrastRange(0.5, 1.6)
NNUNET_BRATS2020 = NNUNET.with_changes(
    spatial={"p_rotation": 0.3, "p_scaling": 0.3, "scaling": BGContrastRange(0.65, 1.6),
             "p_synchronize_scaling_across_axes": 0.7, "p_elastic_deform": 0.3,
             "elastic_deform_scale": UniformRange(0.0, 0.25)},
    noise={"p": 0.15},
    blur={"sigma": UniformRange(0.5, 1.5), "synchronize_axes": True},
    brightness={"range": UniformRange(0.7, 1.3)},
    contrast={"range": BGContrastRange(0.65, 1.5)},
    gamma_inverted={"p": 0.15, "range": _BRATS2020_GAMMA},
    additive_brightness={"p": 0.3, "sigma": 0.2},
    gamma={"range": _BRATS2020_GAMMA},
)
