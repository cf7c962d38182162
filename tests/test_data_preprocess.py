from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import write_case

from brats_swap.config import DataConfig
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.data.preprocess import (
    bbox_slices,
    foreground_bbox,
    header_from_meta,
    pad_crop,
    pad_crop_offsets,
    preprocess_case,
    preprocess_settings,
    probabilities_to_original_grid,
    to_original_grid,
    unpad_crop,
)


@pytest.fixture
def loaded(tmp_path):
    write_case(tmp_path, "BraTS2021_00000", "2021", shape=(26, 22, 18))
    return load_case(discover_cases(tmp_path)[0])


def _settings(**changes):
    return preprocess_settings(DataConfig(**changes))


def test_bbox_has_a_one_voxel_margin(loaded):
    bbox = foreground_bbox(loaded.image, loaded.seg)
    mask = np.any(loaded.image != 0, axis=0)
    inside = np.zeros_like(mask)
    inside[bbox_slices(bbox)] = True
    assert not (mask & ~inside).any()  # nothing non-zero is cut
    for axis, (start, stop) in enumerate(bbox):
        hits = np.flatnonzero(mask.any(axis=tuple(a for a in range(3) if a != axis)))
        assert start == max(hits[0] - 1, 0) and stop == min(hits[-1] + 2, mask.shape[axis])


def test_zscore_inside_the_brain_and_background_zero(loaded):
    image, label, meta = preprocess_case(loaded, _settings(fit="pad_crop", cube=[32, 32, 32], cache_dtype="float32"))
    assert image.dtype == np.float32 and image.shape == (4, 32, 32, 32)
    brain = np.any(image != 0, axis=0)
    for channel in range(4):
        values = image[channel][brain]
        assert abs(values.mean()) < 1e-3 and abs(values.std() - 1) < 1e-2
    assert meta["normalization"]["t1"]["clip"][0] < meta["normalization"]["t1"]["clip"][1]
    assert label.dtype == np.uint8 and set(np.unique(label)) == {0, 1, 2, 4}


def test_pad_crop_round_trip_is_exact(loaded):
    # 20 is smaller than the box on some axes (centre crop) and larger on others (padding).
    _, label_cube, meta = preprocess_case(loaded, _settings(fit="pad_crop", cube=[20, 28, 14]))
    back = to_original_grid(label_cube, meta)
    assert back.shape == loaded.seg.shape and back.dtype == np.uint8
    box = bbox_slices(meta["bbox"])
    offsets = meta["pad_crop_offsets"]
    kept = tuple(slice(a.start + max(0, -o), min(a.stop, a.start - o + c))
                 for a, o, c in zip(box, offsets, meta["cube"], strict=True))
    assert np.array_equal(back[kept], loaded.seg[kept])  # every voxel the cube kept comes back exactly
    outside = np.ones(back.shape, dtype=bool)
    outside[kept] = False
    assert not back[outside].any()  # outside the kept box is background


def test_pad_crop_round_trip_without_cropping_equals_the_original(loaded):
    _, label_cube, meta = preprocess_case(loaded, _settings(fit="pad_crop", cube=[32, 32, 32]))
    assert np.array_equal(to_original_grid(label_cube, meta), loaded.seg)


def test_resample_round_trip_is_exact_when_the_cube_is_the_box(loaded):
    bbox = foreground_bbox(loaded.image, loaded.seg)
    box_shape = [b - a for a, b in bbox]
    image, label_cube, meta = preprocess_case(loaded, _settings(fit="resample", cube=box_shape))
    assert np.array_equal(to_original_grid(label_cube, meta), loaded.seg)


def test_resample_to_a_bigger_cube_maps_back_closely(loaded):
    _, label_cube, meta = preprocess_case(loaded, _settings(fit="resample", cube=[40, 40, 40]))
    assert label_cube.shape == (40, 40, 40)
    assert meta["cube_spacing"][0] == pytest.approx(meta["bbox_shape"][0] / 40)
    back = to_original_grid(label_cube, meta)
    assert (back == loaded.seg).mean() > 0.97
    assert set(np.unique(back)) <= {0, 1, 2, 4}


def test_probabilities_map_back_linearly_and_zero_outside(loaded):
    _, label_cube, meta = preprocess_case(loaded, _settings(fit="resample", cube=[24, 24, 24]))
    probs = np.stack([(label_cube == v).astype(np.float32) for v in (1, 2, 4)])
    back = probabilities_to_original_grid(torch.from_numpy(probs), meta)
    assert back.shape == (3, *loaded.seg.shape) and back.dtype == np.float32
    assert back.min() >= 0 and back.max() <= 1
    outside = np.ones(loaded.seg.shape, dtype=bool)
    outside[bbox_slices(meta["bbox"])] = False
    assert not back[:, outside].any()
    # thresholding the mapped edema probability agrees with the original edema mostly
    assert ((back[1] > 0.5) == (loaded.seg == 2)).mean() > 0.95
    with pytest.raises(ValueError, match="prepared cube"):
        to_original_grid(np.zeros((8, 8, 8), np.uint8), meta)


def test_pad_crop_helpers_are_inverse_inside_the_cube():
    rng = np.random.default_rng(0)
    box = rng.integers(0, 5, size=(2, 7, 12, 9)).astype(np.uint8)
    offsets = pad_crop_offsets(box.shape[1:], (10, 10, 10))
    assert offsets == [1, -1, 0]
    restored = unpad_crop(pad_crop(box, (10, 10, 10), offsets), box.shape[1:], offsets)
    assert np.array_equal(restored[:, :, 1:11], box[:, :, 1:11]) and not restored[:, :, [0, 11]].any()


def test_meta_keeps_the_header(loaded):
    _, _, meta = preprocess_case(loaded, _settings(cube=[16, 16, 16]))
    header = header_from_meta(meta)
    assert header.get_zooms() == loaded.header.get_zooms()
    assert np.allclose(header.get_best_affine(), loaded.affine)
