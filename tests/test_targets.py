"""Label maps <-> network channels for both editions and both output kinds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from brats_swap.data.editions import get_edition
from brats_swap.model.targets import core_label, labels_from_probs, num_outputs, targets_from_labels


def random_label(edition: str, shape, seed: int = 0) -> np.ndarray:
    values = np.array((0,) + get_edition(edition).label_values, dtype=np.uint8)
    return np.random.default_rng(seed).choice(values, size=shape).astype(np.uint8)


@pytest.mark.parametrize("edition", ["2021", "2023"])
@pytest.mark.parametrize("outputs", ["labels", "regions"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("batched", [True, False])
def test_round_trip(edition, outputs, backend, batched):
    shape = (2, 5, 6, 7) if batched else (5, 6, 7)
    label = random_label(edition, shape)
    if backend == "torch":
        label = torch.from_numpy(label)
    targets = targets_from_labels(label, edition, outputs)
    channel_dim = 1 if batched else 0
    assert targets.shape[channel_dim] == 3 == num_outputs(edition, outputs)
    assert tuple(targets.shape[:channel_dim] + targets.shape[channel_dim + 1:]) == tuple(label.shape)
    assert str(targets.dtype).endswith("float32")
    back = labels_from_probs(targets, edition, outputs)
    assert type(back) is type(label)
    assert back.dtype in (np.uint8, torch.uint8)
    assert (back == label).all()


def test_label_channels_follow_the_edition_table():
    spec = get_edition("2021")
    label = torch.tensor([[[[0, 1, 2, 4]]]], dtype=torch.uint8)  # (B=1, 1, 1, 4)
    targets = targets_from_labels(label, spec, "labels")[0, :, 0, 0]
    assert targets.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    regions = targets_from_labels(label, spec, "regions")[0, :, 0, 0]
    assert regions.tolist() == [[0, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1]]  # WT, TC, ET
    label23 = np.array([[[0, 1, 2, 3]]], dtype=np.uint8)
    assert targets_from_labels(label23, "2023", "regions")[:, 0, 0].tolist() == [[0, 1, 1, 1], [0, 1, 0, 1],
                                                                                  [0, 0, 0, 1]]
    assert core_label("2021") == 1 and core_label("2023") == 1


def test_labels_argmax_and_threshold():
    probs = np.array([[0.9, 0.3, 0.2, 0.1], [0.6, 0.4, 0.8, 0.3], [0.2, 0.45, 0.7, 0.2]], dtype=np.float32)
    probs = probs.reshape(3, 1, 1, 4)
    # Voxel 0: channel 0 -> label 1; voxel 1: max 0.45 (channel 2) < 0.5 -> 0; voxel 2: channel 1 -> 2; voxel 3: 0.
    assert labels_from_probs(probs, "2021", "labels").ravel().tolist() == [1, 0, 2, 0]
    assert labels_from_probs(torch.from_numpy(probs), "2021", "labels").flatten().tolist() == [1, 0, 2, 0]
    assert labels_from_probs(probs, "2021", "labels", threshold=0.4).ravel().tolist() == [1, 4, 2, 0]
    assert labels_from_probs(probs[[2, 1, 0]], "2023", "labels").ravel().tolist() == [3, 0, 2, 0]


def test_regions_are_nested():
    # WT, TC, ET per voxel; ET without WT must not produce a label, TC without WT neither.
    probs = np.array([[0.9, 0.9, 0.9, 0.1, 0.1, 0.9],
                      [0.1, 0.9, 0.9, 0.9, 0.1, 0.2],
                      [0.1, 0.1, 0.9, 0.9, 0.9, 0.9]], dtype=np.float32).reshape(3, 1, 1, 6)
    for edition in ("2021", "2023"):
        spec = get_edition(edition)
        expected = [spec.edema, core_label(spec), spec.enhancing, 0, 0, spec.edema]
        assert labels_from_probs(probs, edition, "regions").ravel().tolist() == expected
        batched = torch.from_numpy(probs)[None]
        assert labels_from_probs(batched, edition, "regions").flatten().tolist() == expected


def test_wrong_channel_count_raises():
    with pytest.raises(ValueError, match="channels"):
        labels_from_probs(np.zeros((4, 2, 2, 2), np.float32), "2021", "labels")
