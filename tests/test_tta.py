"""Test-time augmentation by mirroring: the 8-mirror average is flip-equivariant, for whole-cube and
sliding-window inference alike.

Why a tolerance and not bit equality: TTA(flip_F(x)) and flip_F(TTA(x)) add up the same 8 network outputs
(flip_F only permutes which mirroring produces which term, and each term is the model applied to the same
input voxels, so it is bit-identical), but in a different order. The sum is taken in float64 and rounded
to float32 once, so reordering can change the result by at most about one float32 ulp (~6e-8 for values
below 1): in practice the results are bit-identical, but that is not guaranteed, so the tests allow 1e-6.
Without TTA the same model is far from equivariant, which shows that the assertion can fail.
"""

from __future__ import annotations

import pytest
import torch

from brats_swap.config import load_config
from brats_swap.model import build_model
from brats_swap.run.inference import mirror_subsets, predict_cube, predict_ensemble, predict_mirrored

SHAPE = (16, 16, 16)
CPU = torch.device("cpu")


def tiny_unet(seed: int = 0) -> torch.nn.Module:
    """The project's U-Net with 4 base filters and 3 levels, randomly initialised (no training needed:
    equivariance is a property of the averaging, not of the weights)."""
    torch.manual_seed(seed)
    config = load_config(None, ["model.base_filters=4", "model.depth=3", "model.segmentation_levels=2",
                                "data.cube=[16,16,16]"])
    return build_model(config.model, out_channels=3).eval()


def inference_config(mode: str):
    return load_config(None, ["data.cube=[16,16,16]", "model.depth=3", "model.segmentation_levels=2",
                              f"train.mode={mode}", "train.patch=[8,8,8]", "evaluate.sw_overlap=0",
                              "train.device=cpu"])


def test_the_eight_mirrorings_are_every_subset_of_the_spatial_axes():
    subsets = mirror_subsets()
    assert len(subsets) == 8 and len(set(subsets)) == 8
    assert subsets[0] == () and (2, 3, 4) in subsets
    assert all(set(subset) <= {2, 3, 4} for subset in subsets)


@pytest.mark.parametrize("mode", ["full", "patch"])
def test_tta_prediction_of_a_mirrored_case_is_the_mirrored_prediction(mode):
    model, config = tiny_unet(), inference_config(mode)
    torch.manual_seed(1)
    image = torch.randn(1, 4, *SHAPE)
    reference = predict_cube(model, image, config, CPU, tta=True)
    assert reference.shape == (1, 3, *SHAPE) and reference.dtype == torch.float32
    for flip in mirror_subsets()[1:]:
        mirrored = predict_cube(model, image.flip(flip), config, CPU, tta=True)
        torch.testing.assert_close(mirrored, reference.flip(flip), rtol=0, atol=1e-6)
    # The plain prediction of the same model is not equivariant: the check above could fail.
    plain = predict_cube(model, image, config, CPU)
    plain_mirrored = predict_cube(model, image.flip((2,)), config, CPU)
    assert (plain_mirrored - plain.flip((2,))).abs().max() > 1e-3


def test_tta_is_the_mean_of_the_eight_flipped_back_predictions():
    model, config = tiny_unet(), inference_config("full")
    image = torch.randn(1, 4, *SHAPE)
    expected = torch.stack([predict_cube(model, image.flip(s), config, CPU).flip(s) if s else
                            predict_cube(model, image, config, CPU) for s in mirror_subsets()]).double().mean(0)
    torch.testing.assert_close(predict_cube(model, image, config, CPU, tta=True), expected.float(), rtol=0, atol=1e-6)
    calls = []
    predict_mirrored(lambda batch: calls.append(batch.shape) or batch[:, :1].sigmoid(), image)
    assert len(calls) == 8


def test_an_ensemble_averages_its_members():
    config = inference_config("full")
    first, second = tiny_unet(0), tiny_unet(1)
    image = torch.randn(1, 4, *SHAPE)
    expected = (predict_cube(first, image, config, CPU).double() + predict_cube(second, image, config, CPU).double()) / 2
    ensemble = predict_ensemble([(first, config), (second, config)], image, CPU)
    torch.testing.assert_close(ensemble, expected.float(), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="no model"):
        predict_ensemble([], image, CPU)
