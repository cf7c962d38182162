"""augment_batch as a batched function: deterministic given its parameters, batching changes nothing, the
inputs stay untouched, bad input is refused, augment_buffer_bytes bounds what it allocates, and a new step
is one class and one line in a recipe's tuple."""

from __future__ import annotations

import dataclasses
import math
import pickle
import weakref
from typing import ClassVar

import numpy as np
import pytest
import torch
from augment_helpers import LABEL_VALUES, neutral, volume
from torch.utils._python_dispatch import TorchDispatchMode

from brats_swap.augment import get_recipe
from brats_swap.augment.nnunet import NnunetAugment
from brats_swap.augment.pipeline import augment_batch, augment_buffer_bytes
from brats_swap.augment.recipes import NNUNET

PATCH = (24, 24, 24)
STEPS = NNUNET.steps  # every transform's step (with a value that fires, additive brightness runs too)
NNUNET_RECIPES = ("nnunet", "nnunet_brats2020")


def _batch(size: int, batch: int, channels: int = 2):
    pairs = [volume(channels, size, seed) for seed in range(batch)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _busy(channels: int, seed: int, **fields):
    """Parameters that fire every transform, so every code path runs."""
    base = dict(rotation=(0.2, -0.3, 0.1), scaling=(1.1, 0.9, 1.2), elastic_sigmas=(4.0, 4.0, 4.0),
                elastic_magnitudes=(1.0, 2.0, 1.5), noise=0.05,
                blur=((0.7, 0.8, 0.9),) + ((0.0, 0.0, 0.0),) * (channels - 1),
                brightness=(1.1,) * channels, contrast=(0.8,) * channels,
                low_resolution=(0.6,) + (1.0,) * (channels - 1), gamma_inverted=(1.3,) * channels,
                additive_brightness=(0.1,) * channels, gamma=(0.8,) * channels, mirror=(True, False, True))
    base.update(fields)
    return neutral(channels, seed=seed, **base)


def test_deterministic_given_the_parameters_and_seeds_matter():
    images, labels = _batch(32, 2)
    params = [_busy(2, 10), _busy(2, 11)]
    first = augment_batch(images, labels, params, PATCH, LABEL_VALUES, steps=STEPS)
    again = augment_batch(images, labels, params, PATCH, LABEL_VALUES, steps=STEPS)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    reseeded = augment_batch(images, labels, [dataclasses.replace(p, seed=p.seed + 100) for p in params], PATCH,
                             LABEL_VALUES, steps=STEPS)
    assert not torch.allclose(first[0], reseeded[0])  # another noise image and elastic field


def test_a_batch_equals_its_samples_one_by_one():
    images, labels = _batch(32, 3)
    params = [_busy(2, 1), neutral(2, seed=2, gamma=(1.2, 0.9), mirror=(False, True, False)),
              _busy(2, 3, elastic_magnitudes=(0.0, 0.0, 0.0), noise=0.0)]
    out_images, out_labels = augment_batch(images, labels, params, PATCH, LABEL_VALUES, steps=STEPS)
    for b, p in enumerate(params):
        one_images, one_labels = augment_batch(images[b:b + 1], labels[b:b + 1], [p], PATCH, LABEL_VALUES,
                                               steps=STEPS)
        assert torch.allclose(out_images[b], one_images[0], atol=1e-5)
        assert torch.equal(out_labels[b], one_labels[0])


def test_outputs_masked_and_minus_one_gone_inputs_untouched():
    images, labels = _batch(32, 2)
    before = images.clone(), labels.clone()
    out_images, out_labels = augment_batch(images, labels, [_busy(2, 0), neutral(2)], PATCH, LABEL_VALUES,
                                           steps=STEPS)
    assert torch.equal(images, before[0]) and torch.equal(labels, before[1])
    assert out_images.shape == (2, 2, *PATCH) and out_labels.shape == (2, *PATCH)
    assert out_images.dtype == torch.float32 and out_labels.dtype == labels.dtype
    assert set(out_labels.unique().tolist()) <= set(LABEL_VALUES)
    # the neutral sample is the centre crop, zero outside the brain
    crop = labels[1, 4:28, 4:28, 4:28]
    assert torch.equal(out_labels[1], crop.clamp_min(0))
    assert torch.equal(out_images[1], torch.where(crop[None] < 0, 0.0, images[1, :, 4:28, 4:28, 4:28]))


def test_a_crop_larger_than_the_input_pads_with_minus_one_which_the_mask_step_zeroes():
    """The crop-only path (no resampling drawn) pads as nnunetv2 2.8.1's crop does: labels with -1, so the
    mask step puts the padding back to 0 after a contrast change; without the mask step it stays moved."""
    images, labels = _batch(20, 1)
    labels.clamp_(min=0)  # a brain filling the input
    ring = torch.ones(PATCH, dtype=torch.bool)
    ring[2:22, 2:22, 2:22] = False
    masked = augment_batch(images, labels, [neutral(2, contrast=(1.5, 0.7))], PATCH, LABEL_VALUES, steps=STEPS)
    assert (masked[0][0][:, ring] == 0).all() and (masked[1][0][ring] == 0).all()
    assert STEPS[-1].name == "mask_outside"
    unmasked = augment_batch(images, labels, [neutral(2, steps=STEPS[:-1], contrast=(1.5, 0.7))], PATCH,
                             LABEL_VALUES, steps=STEPS[:-1])
    assert (unmasked[1][0][ring] == -1).all() and (unmasked[0][0][:, ring] != 0).all()
    assert torch.equal(masked[0][0][:, ~ring], unmasked[0][0][:, ~ring])  # inside the input both are alike


def test_parameters_are_picklable_and_drawn_from_the_generator_alone():
    for name in NNUNET_RECIPES:
        recipe = get_recipe(name)
        a = recipe.draw(np.random.default_rng(5), PATCH, 4)
        b = recipe.draw(np.random.default_rng(5), PATCH, 4)
        assert a == b and pickle.loads(pickle.dumps(a)) == a
        assert a != recipe.draw(np.random.default_rng(6), PATCH, 4)


def test_enlarged_crop_is_nnunets_get_patch_size():
    # nnU-Net's 128^3 patch is cropped at 205^3 (get_patch_size with +-30 deg and 1 / 0.85)
    assert get_recipe("nnunet").crop_size((128, 128, 128), patch_mode=True) == (205, 205, 205)
    assert get_recipe("nnunet").crop_size((160, 192, 160), patch_mode=True) == (275, 289, 257)
    assert get_recipe("nnunet_brats2020").crop_size((128, 128, 128), patch_mode=True) == (205, 205, 205)


def test_an_enlarged_crop_input_gives_the_patch():
    images, labels = _batch(40, 2)
    out_images, out_labels = augment_batch(images, labels, [_busy(2, 0), neutral(2)], PATCH, LABEL_VALUES,
                                           steps=STEPS)
    assert out_images.shape == (2, 2, *PATCH)
    assert torch.equal(out_labels[1], labels[1, 8:32, 8:32, 8:32].clamp_min(0))


@pytest.mark.parametrize("bad, message", [
    ({"labels": torch.zeros((2, 24, 24), dtype=torch.int64)}, "must be"),
    ({"params": [None]}, "parameter sets"),
    ({"label_values": (1, 2, 3)}, "background 0"),
    ({"patch_size": (24, 24)}, "not 3D"),
    ({"params": [neutral(3), neutral(3)]}, "drawn for 3 channels"),
    ({"steps": STEPS[:-1]}, "the recipe runs"),
])
def test_bad_input_is_refused_in_one_line(bad, message):
    images, labels = _batch(24, 2)
    kwargs = dict(images=images, labels=labels, params=[neutral(2), neutral(2)], patch_size=PATCH,
                  label_values=LABEL_VALUES, steps=STEPS)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=message):
        augment_batch(**kwargs)


@pytest.mark.parametrize("steps, message", [
    (STEPS[:-1], "must end with MaskOutside"),
    ((*STEPS[:2], STEPS[1], *STEPS[2:]), "not unique"),
])
def test_a_recipe_without_the_mask_last_or_with_a_step_twice_is_refused(steps, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(NNUNET, steps=steps)


class _PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still referenced (inputs excluded)."""

    def __init__(self, external):
        super().__init__()
        self.owners: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.external = {t.untyped_storage().data_ptr() for t in external}
        self.live = self.peak = 0

    def _release(self, key):
        self.owners[key] -= 1
        if self.owners[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.owners[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.external or key == 0:
                continue
            if key not in self.owners:
                self.owners[key] = 0
                self.sizes[key] = t.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
            self.owners[key] += 1
            weakref.finalize(t, self._release, key)
        return out


@pytest.mark.parametrize("input_size", [24, 34])
@pytest.mark.parametrize("which", ["all resample", "one resamples", "intensity only"])
def test_buffer_bytes_bound_what_augment_batch_allocates(input_size, which):
    images, labels = _batch(input_size, 2, channels=4)
    params = {"all resample": [_busy(4, 0), _busy(4, 1)],
              "one resamples": [_busy(4, 0, elastic_magnitudes=(0.0, 0.0, 0.0)), neutral(4)],
              "intensity only": [neutral(4, gamma=(0.8,) * 4), neutral(4, blur=((1.0, 1.0, 1.0),) * 4)]}
    with _PeakBytes([images, labels]) as mode:
        out = augment_batch(images, labels, params[which], PATCH, LABEL_VALUES, steps=STEPS)
    del out
    bound = augment_buffer_bytes(2, 4, PATCH, len(LABEL_VALUES), (input_size,) * 3, steps=STEPS)
    assert 0 < mode.peak <= bound, (mode.peak, bound)
    if which == "all resample":  # the worst case the planner must count, and the bound is close to it
        assert bound < 1.5 * mode.peak, (mode.peak, bound)


@dataclasses.dataclass(frozen=True)
class _Negate:
    """A step defined here alone: with p, the sample's image negated; it declares `copies` image copies."""

    p: float
    copies: int
    name: ClassVar[str] = "negate"

    def neutral(self, channels):
        return False

    def draw(self, rng, channels):
        return bool(rng.random() < self.p)

    def apply(self, images, labels, values, seeds):
        chosen = [b for b, negate in enumerate(values) if negate]
        if chosen:
            images[chosen] = -images[chosen]

    def buffer_bytes(self, batch, channels, patch_voxels, element_bytes):
        return batch * patch_voxels * channels * element_bytes * self.copies


def test_a_new_step_is_one_class_and_one_line_in_the_recipe():
    """The one door: a step's class and its place in the tuple (before the mask) make it drawn, applied
    by augment_batch and counted by the byte bound, with nothing else edited."""
    with_negate = NnunetAugment(dataclasses.replace(NNUNET, steps=(*STEPS[:-1], _Negate(p=1.0, copies=50),
                                                                   STEPS[-1])))
    plain = get_recipe("nnunet")
    images, labels = _batch(32, 2)
    drawn = [with_negate.draw(np.random.default_rng(k), PATCH, 2) for k in range(2)]
    drawn_plain = [plain.draw(np.random.default_rng(k), PATCH, 2) for k in range(2)]
    assert all(p.value("negate") is True for p in drawn)
    # drawn after every other step: the others' values are the plain recipe's
    assert [[s for s in p.steps if s[0] != "negate"] for p in drawn] == [list(p.steps) for p in drawn_plain]
    negated = with_negate.apply(images, labels, drawn, PATCH, LABEL_VALUES)
    reference = plain.apply(images, labels, drawn_plain, PATCH, LABEL_VALUES)
    assert reference[0].abs().sum() > 0 and torch.equal(negated[0], -reference[0])
    assert torch.equal(negated[1], reference[1])
    # its declared 50 image copies outweigh the spatial transform's peak, so they set the bound
    patch = math.prod(PATCH)
    outputs = 2 * patch * (2 * 4 + 8)
    assert with_negate.buffer_bytes(2, 2, PATCH, 4, (32,) * 3) == outputs + 50 * 2 * patch * 2 * 4
    assert plain.buffer_bytes(2, 2, PATCH, 4, (32,) * 3) < outputs + 50 * 2 * patch * 2 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpu_result_for_noise_free_parameters():
    images, labels = _batch(32, 2, channels=4)
    params = [_busy(4, 0, noise=0.0, elastic_magnitudes=(0.0, 0.0, 0.0)), _busy(4, 1, noise=0.0,
                                                                                  rotation=(0.0, 0.0, 0.0))]
    cpu = augment_batch(images, labels, params, PATCH, LABEL_VALUES, steps=STEPS)
    gpu = augment_batch(images.cuda(), labels.cuda(), params, PATCH, LABEL_VALUES, steps=STEPS)
    assert torch.allclose(gpu[0].cpu(), cpu[0], atol=1e-4)
    assert (gpu[1].cpu() == cpu[1]).float().mean() >= 0.999
