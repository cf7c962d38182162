"""The training batch on the device (brats_swap/train/device_augment.py): each recipe turns the loader's float16
batch and its per-sample draws into float32 images and targets, the same for the same draws; the nnU-Net
recipes read an enlarged crop and see the brain mask as nnU-Net does (-1 outside)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from brats_swap.augment import get_recipe, nnunet
from brats_swap.augment.cube import CubeSymmetry, apply_symmetry
from brats_swap.augment.mild import MonaiSeed
from brats_swap.model.targets import targets_from_labels
from brats_swap.train.data import LoaderBatch
from brats_swap.train.device_augment import DeviceBatches, augment_buffers

SIZE = (12, 12, 12)


def loader_batch(recipe: str, size=SIZE, batch: int = 2, seed: int = 0) -> LoaderBatch:
    """A batch as the loader hands it over: float16 images (0 outside a brain ball), uint8 labels, the draws."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(s) - s / 2 for s in size], indexing="ij"))
    brain = (grid**2).sum(0) < (min(size) / 2.2) ** 2
    images = rng.normal(size=(batch, 4, *size)).astype(np.float16) * brain
    labels = rng.choice(np.array([0, 1, 2, 4], np.uint8), size=(batch, *size)) * brain
    draws = [get_recipe(recipe).draw(rng, size, 4) for _ in range(batch)]
    return LoaderBatch(image=torch.from_numpy(images), label=torch.from_numpy(labels.astype(np.uint8)),
                       augment=draws, pad=[None] * batch, case_id=[f"case_{i}" for i in range(batch)])


def batches(recipe: str, outputs: str = "labels") -> DeviceBatches:
    return DeviceBatches(recipe, torch.device("cpu"), edition="2021", outputs=outputs, regions=(), sample_size=SIZE)


def test_cube48_on_the_device_is_each_samples_symmetry_then_its_targets():
    batch = loader_batch("cube48")
    assert all(isinstance(d, CubeSymmetry) for d in batch.augment)
    images, targets = batches("cube48").prepare(batch)
    assert images.dtype == torch.float32 and targets.shape == (2, 3, *SIZE)
    for i, drawn in enumerate(batch.augment):
        expected = apply_symmetry(batch.image[i].float(), drawn.perm, drawn.flips)
        assert torch.equal(images[i], expected)
        label = apply_symmetry(batch.label[i].long(), drawn.perm, drawn.flips)
        assert torch.equal(targets[i], targets_from_labels(label, "2021", "labels"))


def test_none_only_converts_and_mild_follows_its_seed():
    batch = loader_batch("none")
    images, targets = batches("none").prepare(batch)
    assert torch.equal(images, batch.image.float())
    assert torch.equal(targets, targets_from_labels(batch.label.long(), "2021", "labels"))
    mild = batches("mild")
    batch = loader_batch("mild", seed=3)
    assert all(isinstance(d, MonaiSeed) for d in batch.augment)
    first, again = mild.prepare(batch), mild.prepare(batch)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    other = dataclasses.replace(batch, augment=[MonaiSeed(d.seed + 1) for d in batch.augment])
    assert not torch.equal(mild.prepare(other)[0], first[0])


@pytest.mark.parametrize("recipe", ["nnunet", "nnunet_brats2020"])
def test_the_nnunet_recipes_crop_the_enlarged_patch_back_to_the_patch(recipe):
    crop = get_recipe(recipe).crop_size(SIZE, patch_mode=True)
    assert all(c > s for c, s in zip(crop, SIZE, strict=True))  # room for rotations and scaling
    assert get_recipe(recipe).crop_size(SIZE, patch_mode=False) == SIZE  # a whole cube is read as it is
    assert get_recipe("cube48").crop_size(SIZE, patch_mode=True) == SIZE
    batch = dataclasses.replace(loader_batch(recipe, size=crop, seed=1),
                                augment=[get_recipe(recipe).draw(np.random.default_rng(s), SIZE, 4) for s in range(2)])
    device = batches(recipe, outputs="regions")
    images, targets = device.prepare(batch)
    assert images.shape == (2, 4, *SIZE) and targets.shape == (2, 3, *SIZE)
    again = device.prepare(batch)
    assert torch.equal(images, again[0]) and torch.equal(targets, again[1])
    assert set(targets.unique().tolist()) <= {0.0, 1.0}


def test_the_nnunet_recipes_see_minus_one_outside_the_brain(monkeypatch):
    seen = {}

    def record(images, labels, params, patch_size, label_values, steps):
        seen["labels"], seen["images"] = labels.clone(), images.clone()
        return images, labels

    monkeypatch.setattr(nnunet, "augment_batch", record)
    batch = loader_batch("nnunet")
    batches("nnunet").prepare(batch)
    outside = (batch.image == 0).all(dim=1)
    assert torch.equal(seen["labels"] == -1, outside)
    assert torch.equal(seen["labels"][~outside], batch.label[~outside].long())


def test_the_augmentation_buffers_grow_with_the_batch_and_the_enlarged_crop():
    plain = augment_buffers("cube48", 2, 4, (32, 32, 32), 4, patch_mode=True)
    assert plain >= 2 * 32**3 * (4 * 2 + 1)  # at least the float16 batch and its labels as they arrived
    assert augment_buffers("cube48", 4, 4, (32, 32, 32), 4, patch_mode=True) == 2 * plain
    assert augment_buffers("nnunet", 2, 4, (32, 32, 32), 4, patch_mode=True) > plain


def test_the_plan_counts_the_augmentation_buffers_before_the_forward_not_on_top_of_its_peak():
    from brats_swap.config import MemoryConfig, load_config
    from brats_swap.memory.planner import Planner
    from brats_swap.model import build_model
    from brats_swap.train.losses import training_loss
    from brats_swap.train.planning import augmentation_bytes, plan_for_config, training_input_shape

    config = load_config(None, ["data.cube=[16,16,16]", "model.depth=4", "model.base_filters=2",
                                "train.augment=nnunet", "train.batch_size=2"])
    model = build_model(config.model)
    shape, loss = training_input_shape(config), training_loss(config.train.loss, model)
    buffers = augmentation_bytes(config)
    assert buffers == augment_buffers("nnunet", 2, 4, (16, 16, 16), 4, patch_mode=False)
    plain = Planner(model, shape, loss_fn=loss).memory(MemoryConfig())
    counted = Planner(model, shape, loss_fn=loss, prelude_bytes=buffers).memory(MemoryConfig())
    assert counted.peak_bytes == max(plain.peak_bytes, plain.persistent_bytes + buffers)
    # freed before the forward: a prelude under the step's own peak leaves the peak as it was
    small = Planner(model, shape, loss_fn=loss, prelude_bytes=1).memory(MemoryConfig())
    assert small.peak_bytes == plain.peak_bytes
    report, planner = plan_for_config(config, device="cpu")
    assert planner.prelude_bytes == buffers and all(p.peak_bytes >= plain.persistent_bytes + buffers
                                                    for p in report.policies)


def test_the_registry_is_the_one_list_of_recipes_the_config_accepts_and_it_needs_no_torch():
    import subprocess
    import sys

    from brats_swap.augment import RECIPE_NAMES
    from brats_swap.config import ConfigError, load_config

    assert RECIPE_NAMES == ("cube48", "nnunet", "nnunet_brats2020", "mild", "none")
    for name in RECIPE_NAMES:
        assert load_config(None, [f"train.augment={name}"]).train.augment == name
        recipe = get_recipe(name)
        assert all(callable(getattr(recipe, method)) for method in ("crop_size", "draw", "apply", "buffer_bytes"))
    with pytest.raises(ConfigError, match=r"^train\.augment: 'strong' is not one of cube48, nnunet, "):
        load_config(None, ["train.augment=strong"])
    with pytest.raises(ValueError, match="not one of cube48"):
        get_recipe("strong")
    # the config checks recipe names without importing torch (the registry is the standard library only)
    code = ("import sys; from brats_swap.config import load_config; load_config(None, ['train.augment=mild']); "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
