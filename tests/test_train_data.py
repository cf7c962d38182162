"""The training data pipeline: cube symmetries, patches, and a sample stream independent of workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train_helpers import prepared_dataset

from brats_swap.data.cache import list_prepared
from brats_swap.train.data import (
    CUBE_SYMMETRIES,
    CubeDataset,
    EpochSampler,
    SampleKey,
    allowed_symmetries,
    apply_symmetry,
    random_patch_start,
)


def test_the_48_cube_symmetries_are_distinct_and_only_permute_equal_axes():
    volume = np.arange(4 * 4 * 4).reshape(4, 4, 4)
    images = {apply_symmetry(volume, perm, flips).tobytes() for perm, flips in CUBE_SYMMETRIES}
    assert len(CUBE_SYMMETRIES) == 48 and len(images) == 48
    assert len(allowed_symmetries((8, 8, 8))) == 48
    assert len(allowed_symmetries((8, 8, 4))) == 16  # swap the first two axes or not, times 8 flips
    assert len(allowed_symmetries((8, 6, 4))) == 8  # flips only
    for perm, flips in allowed_symmetries((8, 8, 4)):
        assert apply_symmetry(np.zeros((2, 8, 8, 4)), perm, flips).shape == (2, 8, 8, 4)


def test_a_symmetry_moves_image_channels_and_label_together():
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, size=(6, 6, 6)).astype(np.uint8)
    image = np.stack([(label == k).astype(np.float32) for k in range(3)])  # channel k marks label k
    for perm, flips in CUBE_SYMMETRIES:
        moved_image, moved_label = apply_symmetry(image, perm, flips), apply_symmetry(label, perm, flips)
        np.testing.assert_array_equal(np.argmax(moved_image, axis=0), moved_label)


def test_foreground_patches_contain_tumour():
    label = np.zeros((32, 32, 32), np.uint8)
    label[28:30, 2:4, 20:22] = 2
    rng = np.random.default_rng(0)
    for _ in range(20):
        start = random_patch_start(label.shape, (8, 8, 8), label, rng, foreground_fraction=1.0)
        window = tuple(slice(s, s + 8) for s in start)
        assert label[window].any() and all(0 <= s <= 24 for s in start)


def test_sampler_is_a_seeded_shuffle_and_can_start_mid_epoch():
    sampler = EpochSampler(dataset_length=5, num_samples=7, seed=3)
    keys = list(sampler)
    assert len(keys) == 7 and sorted(k.index for k in keys[:5]) == list(range(5))
    assert keys == list(EpochSampler(5, 7, seed=3))
    sampler.set_epoch(1)
    assert [k.index for k in sampler] != [k.index for k in keys]
    sampler.set_epoch(1, start=4)
    assert [k.position for k in sampler] == [4, 5, 6]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_dataset(tmp_path_factory)


def test_samples_depend_only_on_their_key_not_on_workers(data):
    _, cache = data
    ids = list_prepared(cache)
    dataset = CubeDataset(cache, ids, edition="2021", outputs="labels", crop=(16, 16, 16), patches_per_case=2,
                          augment="cube48", monai_augment=True, seed=7)
    key = SampleKey(epoch=2, position=3, index=5)
    first, again = dataset[key], dataset[key]
    torch.testing.assert_close(first["image"], again["image"])
    assert torch.equal(first["label"], again["label"]) and first["case_id"] == ids[5 // 2]
    assert first["image"].shape == (4, 16, 16, 16) and first["target"].shape == (3, 16, 16, 16)
    # targets are the one-hot labels 1, 2, 4 (model.outputs=labels)
    for channel, value in enumerate((1, 2, 4)):
        assert torch.equal(first["target"][channel].bool(), first["label"] == value)
    other = dataset[SampleKey(epoch=3, position=3, index=5)]
    assert not torch.equal(first["image"], other["image"])

    sampler = EpochSampler(len(dataset), 4, seed=7)
    batches = {}
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers,
                                             collate_fn=lambda samples: torch.stack([s["image"] for s in samples]))
        batches[workers] = [b for b in loader]
    for a, b in zip(batches[0], batches[2], strict=True):
        torch.testing.assert_close(a, b)
