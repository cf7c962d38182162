"""Label maps <-> network channels for every edition and challenge and both output kinds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from brats_swap.data.challenges import CHALLENGES, get_challenge
from brats_swap.errors import ConfigError
from brats_swap.model.targets import (
    labels_from_probs,
    num_outputs,
    output_names,
    region_tree,
    targets_from_labels,
)


def random_label(edition: str, shape, seed: int = 0) -> np.ndarray:
    values = np.array((0,) + get_challenge(edition).label_values, dtype=np.uint8)
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
    spec = get_challenge("2021")
    label = torch.tensor([[[[0, 1, 2, 4]]]], dtype=torch.uint8)  # (B=1, 1, 1, 4)
    targets = targets_from_labels(label, spec, "labels")[0, :, 0, 0]
    assert targets.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    regions = targets_from_labels(label, spec, "regions")[0, :, 0, 0]
    assert regions.tolist() == [[0, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1]]  # WT, TC, ET
    label23 = np.array([[[0, 1, 2, 3]]], dtype=np.uint8)
    assert targets_from_labels(label23, "2023", "regions")[:, 0, 0].tolist() == [[0, 1, 1, 1], [0, 1, 0, 1],
                                                                                  [0, 0, 0, 1]]
    assert region_tree("2021")["TC"].own_label == 1 and region_tree("2023")["TC"].own_label == 1


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
        spec = get_challenge(edition)
        expected = [spec.edema, region_tree(spec)["TC"].own_label, spec.enhancing, 0, 0, spec.edema]
        assert labels_from_probs(probs, edition, "regions").ravel().tolist() == expected
        batched = torch.from_numpy(probs)[None]
        assert labels_from_probs(batched, edition, "regions").flatten().tolist() == expected


def test_wrong_channel_count_raises():
    with pytest.raises(ValueError, match="channels"):
        labels_from_probs(np.zeros((4, 2, 2, 2), np.float32), "2021", "labels")


@pytest.mark.parametrize("challenge", list(CHALLENGES))
@pytest.mark.parametrize("outputs", ["labels", "regions"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_every_challenge_round_trips_exactly(challenge, outputs, backend):
    label = random_label(challenge, (2, 6, 5, 4), seed=3)
    assert set(np.unique(label)) == {0, *get_challenge(challenge).label_values}  # every label is exercised
    if backend == "torch":
        label = torch.from_numpy(label)
    targets = targets_from_labels(label, challenge, outputs)
    assert targets.shape[1] == num_outputs(challenge, outputs)
    back = labels_from_probs(targets, challenge, outputs)
    assert (back == label).all()


@pytest.mark.parametrize(("challenge", "names"), [
    ("2021", ["WT", "TC", "ET"]), ("gli", ["WT", "TC", "ET"]), ("gli-post", ["WT", "TC", "ET", "RC"]),
    ("met", ["WT", "TC", "ET", "RC"]), ("men", ["WT", "TC", "ET"]), ("ssa", ["WT", "TC", "ET"]),
    ("goat", ["WT", "TC", "ET"]), ("ped", ["WT", "TC", "ET", "CC"]), ("men-rt", ["GTV"]),
])
def test_default_regions_per_challenge(challenge, names):
    assert output_names(challenge, "regions") == names
    assert num_outputs(challenge, "labels") == len(get_challenge(challenge).labels)


def test_ped_regions_recover_netc_cc_and_ed():
    ped = get_challenge("ped")
    label = np.array([[[0, 1, 2, 3, 4]]], dtype=np.uint8)  # 0, ET, NETC, CC, ED
    targets = targets_from_labels(label, "ped", "regions")[:, 0, 0]
    assert targets.tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0]]  # WT TC ET CC
    assert {name: r.own_label for name, r in region_tree(ped).items()} == {"WT": 4, "TC": 2, "ET": 1, "CC": 3}


def test_disjoint_siblings_go_to_the_more_probable_one():
    # GLI post-treatment: RC is disjoint from WT; PED: ET and CC are disjoint inside TC.
    probs = np.zeros((4, 1, 1, 3), dtype=np.float32)  # WT, TC, ET, RC
    probs[:, 0, 0, 0] = [0.9, 0.1, 0.1, 0.6]  # both WT and RC: WT wins -> SNFH
    probs[:, 0, 0, 1] = [0.6, 0.1, 0.1, 0.9]  # RC wins
    probs[:, 0, 0, 2] = [0.1, 0.9, 0.9, 0.7]  # TC/ET without WT -> only RC
    assert labels_from_probs(probs, "gli-post", "regions").ravel().tolist() == [2, 4, 4]
    ped = np.zeros((4, 1, 1, 2), dtype=np.float32)  # WT, TC, ET, CC
    ped[:, 0, 0, 0] = [0.9, 0.9, 0.8, 0.7]
    ped[:, 0, 0, 1] = [0.9, 0.9, 0.7, 0.8]
    assert labels_from_probs(torch.from_numpy(ped), "ped", "regions").flatten().tolist() == [1, 3]


def _legacy_nested_rule(probs: np.ndarray, spec, threshold: float) -> np.ndarray:
    """The 2017-2021 rule as it was written before the challenge table: a fixed WT/TC/ET chain."""
    wt, tc, et = (probs[i] > threshold for i in range(3))
    label = np.zeros(wt.shape, dtype=np.uint8)
    label[wt] = spec.edema
    label[wt & tc] = 1
    label[wt & tc & et] = spec.enhancing
    return label


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_legacy_regions_decode_exactly_as_before(threshold):
    probs = np.random.default_rng(5).random((3, 9, 8, 7), dtype=np.float32)
    spec = get_challenge("2021")
    expected = _legacy_nested_rule(probs, spec, threshold)
    assert np.array_equal(labels_from_probs(probs, "2021", "regions", threshold), expected)
    assert np.array_equal(labels_from_probs(torch.from_numpy(probs), "2021", "regions", threshold).numpy(), expected)


def test_configured_regions_and_their_checks():
    assert output_names("ped", "regions", ["WT", "TC", "CC", "ET"]) == ["WT", "TC", "CC", "ET"]
    label = random_label("ped", (4, 4, 4), seed=1)
    targets = targets_from_labels(label, "ped", "regions", ["ET", "NETC", "CC", "ED"])  # disjoint labels
    assert (labels_from_probs(targets, "ped", "regions", regions=["ET", "NETC", "CC", "ED"]) == label).all()
    with pytest.raises(ConfigError, match=r"model.regions: 'XX' is not an evaluation group of the ped table"):
        num_outputs("ped", "regions", ["WT", "XX"])
    with pytest.raises(ConfigError, match=r"model.regions: TC owns 2 labels"):
        region_tree("ped", ["WT", "TC", "ET"])  # NETC and CC cannot be told apart
    with pytest.raises(ConfigError, match=r"label 1 \(NETC\) is in no region"):
        region_tree("gli", ["SNFH", "ET"])
    overlapping = dataclasses.replace(get_challenge("gli"), groups={**get_challenge("gli").groups, "X": (1, 2)})
    with pytest.raises(ConfigError, match=r"TC and X overlap without one holding the other"):
        region_tree(overlapping, ["WT", "TC", "ET", "X"])
    with pytest.raises(ConfigError, match=r"two regions hold the same labels"):
        region_tree("men-rt", ["GTV", "GTV"])
