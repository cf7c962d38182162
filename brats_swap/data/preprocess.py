"""From a loaded case to the network's cube, and from the cube back to the original grid.

The steps (those of Ellis's `3DUnetCNN` preprocessing, which the paper used, plus the map back):

1. Crop to the bounding box of the voxels that are non-zero in any modality (or the segmentation), plus a
   1-voxel margin: what Ellis's `crop_img(..., pad=1)` did. BraTS volumes are skull-stripped with a zero
   background, so this is the head.
2. Per modality, inside the brain mask (voxels non-zero in any modality): clip to the
   `data.clip_percentiles` percentiles, then z-score with that modality's own mean and std; the background
   stays 0. (Ellis used one dataset-wide mean/std over the whole cube; a per-case z-score inside the brain
   is the usual choice since Isensee and does not let the background dominate the statistics.)
3. Fit the box to `data.cube`:
   - `resample` (Ellis/IBM, what the paper trained on): stretch the box anisotropically to the cube,
     trilinear for images, nearest for labels: torch's `F.interpolate` (`align_corners=False`, i.e. voxel
     centres of an extent-aligned grid like SimpleITK's, and `nearest-exact`, SimpleITK's centred nearest
     neighbour); the same call inverts it. A process without torch (`predict --runtime onnxruntime`)
     resizes with a numpy form of torch's CPU kernel, equal to it bit for bit here (tests/test_onnx.py) and
     about 6x slower, so torch's runs wherever torch is already loaded.
   - `pad_crop` (keeps 1 mm voxels): centre the box in the cube, zero-padding axes that are shorter and
     centre-cropping axes that are longer.

Axis convention: the cube's (D, H, W) are the file's voxel axes (X, Y, Z) in order; nothing is transposed.
`meta` (stored next to every prepared case) holds what is needed to go back: `to_original_grid` maps a
cube label map (nearest) and `probabilities_to_original_grid` maps channel probabilities (linear) onto the
original voxel grid; everything outside the bounding box is background.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

import nibabel as nib
import numpy as np

from brats_swap.data.challenges import get_challenge
from brats_swap.data.nifti import LoadedCase
from brats_swap.errors import DataError

# Bump when the arrays a given configuration produces change, so caches re-prepare themselves.
PREPROCESS_VERSION = 1
BBOX_MARGIN = 1  # voxels around the non-zero box, as Ellis's crop_img(pad=1)
FIT_MODES = ("resample", "pad_crop")


def preprocess_settings(data_cfg) -> dict[str, Any]:
    """The configuration that determines a prepared case's arrays (a change re-prepares the cache)."""
    return {
        "version": PREPROCESS_VERSION,
        "edition": str(data_cfg.edition),
        # Absent while auto, so caches prepared before the key existed stay valid.
        **({"challenge": str(data_cfg.challenge)} if data_cfg.challenge != "auto" else {}),
        "modalities": list(data_cfg.modalities),
        "cube": [int(s) for s in data_cfg.cube],
        "fit": str(data_cfg.fit),
        "cache_dtype": str(data_cfg.cache_dtype),
        "clip_percentiles": [float(p) for p in data_cfg.clip_percentiles],
        "bbox_margin": BBOX_MARGIN,
    }


def preprocess_case(loaded: LoadedCase, settings: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """Crop, normalize and fit one case. Returns (image (C, D, H, W) in `cache_dtype`, label (D, H, W) uint8
    with raw label values or None, meta)."""
    cube = tuple(int(s) for s in settings["cube"])
    fit = settings["fit"]
    if fit not in FIT_MODES:
        raise DataError(f"data.fit: unknown fit mode {fit!r} (known: {', '.join(FIT_MODES)})")
    if len(cube) != 3 or min(cube) < 1:
        raise DataError(f"data.cube: expected three positive sizes, got {list(cube)}")

    bbox = foreground_bbox(loaded.image, loaded.seg, margin=BBOX_MARGIN)
    if bbox is None:
        raise DataError(f"case {loaded.case_id}: every voxel of every modality is zero")
    box = bbox_slices(bbox)
    cropped = loaded.image[(slice(None), *box)]
    normalized, stats = normalize_modalities(cropped, settings["clip_percentiles"], loaded.modalities)
    label_box = loaded.seg[box] if loaded.seg is not None else None
    bbox_shape = tuple(int(b - a) for a, b in bbox)

    if fit == "resample":
        image_cube = resize_image(normalized, cube)
        label_cube = resize_label(label_box, cube) if label_box is not None else None
        offsets = None
        cube_spacing = [s * b / c for s, b, c in zip(loaded.spacing, bbox_shape, cube, strict=True)]
    else:
        offsets = pad_crop_offsets(bbox_shape, cube)
        image_cube = pad_crop(normalized, cube, offsets)
        label_cube = pad_crop(label_box, cube, offsets) if label_box is not None else None
        cube_spacing = list(loaded.spacing)
    cropped = cropped_label_voxels(loaded, settings) if label_box is not None else {}
    warnings = [*loaded.warnings, *([describe_cropped(loaded.case_id, cropped, settings)] if cropped else [])]

    meta = {
        "case_id": loaded.case_id,
        "edition": loaded.edition,
        "modalities": list(loaded.modalities),
        "original_shape": list(loaded.shape),
        "affine": np.asarray(loaded.affine, dtype=float).tolist(),
        "spacing": list(loaded.spacing),
        "header": base64.b64encode(loaded.header.binaryblock).decode("ascii"),
        "bbox": [[int(a), int(b)] for a, b in bbox],
        "bbox_shape": list(bbox_shape),
        "fit": fit,
        "cube": list(cube),
        "pad_crop_offsets": offsets,  # cube index = box index + offset (pad_crop only)
        "cube_spacing": cube_spacing,  # mm per cube voxel along D, H, W
        "normalization": stats,
        "has_label": label_cube is not None,
        "label_counts": _label_counts(loaded.seg) if loaded.seg is not None else None,
        "cropped_labels": cropped,  # label abbreviation -> tumour voxels that fitting to the cube removed
        "settings": settings,
        "warnings": warnings,
    }
    return image_cube.astype(settings["cache_dtype"], copy=False), label_cube, meta


def cropped_label_voxels(loaded: LoadedCase, settings: dict[str, Any]) -> dict[str, int]:
    """Label abbreviation -> voxels of that label that fitting the case to the cube removes: those of the
    box that `pad_crop` cuts off (`resample` keeps the whole box); {} when nothing is lost."""
    if loaded.seg is None or settings["fit"] != "pad_crop":
        return {}
    bbox = foreground_bbox(loaded.image, loaded.seg, margin=BBOX_MARGIN)
    if bbox is None:
        return {}
    box = loaded.seg[bbox_slices(bbox)]
    cube = tuple(int(s) for s in settings["cube"])
    kept, _ = _overlap(box.shape, cube, pad_crop_offsets(box.shape, cube))
    before, after = np.bincount(box.ravel(), minlength=256), np.bincount(box[kept].ravel(), minlength=256)
    labels = get_challenge(loaded.edition).labels
    return {labels.get(value, str(value)): int(before[value] - after[value])
            for value in range(1, 256) if before[value] > after[value]}


def describe_cropped(case_id: str, cropped: dict[str, int], settings: dict[str, Any]) -> str:
    """The one-line warning for tumour voxels lost to `pad_crop`, with the settings that keep them."""
    lost = ", ".join(f"{name} {count}" for name, count in cropped.items())
    cube = "x".join(str(int(s)) for s in settings["cube"])
    return (f"case {case_id}: fitting to the cube {cube} (pad_crop) removes tumour voxels: {lost} "
            "(set a larger data.cube, or data.fit=resample)")


def foreground_bbox(image: np.ndarray, seg: np.ndarray | None = None, margin: int = BBOX_MARGIN):
    """[(start, stop)] per spatial axis of voxels non-zero in any channel (or labelled), plus `margin`."""
    mask = np.any(image != 0, axis=0)
    if seg is not None:
        mask |= seg != 0
    bbox = []
    for axis in range(mask.ndim):
        other = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(mask.any(axis=other))
        if hits.size == 0:
            return None
        bbox.append((max(int(hits[0]) - margin, 0), min(int(hits[-1]) + 1 + margin, mask.shape[axis])))
    return bbox


def bbox_slices(bbox) -> tuple[slice, ...]:
    return tuple(slice(int(a), int(b)) for a, b in bbox)


def normalize_modalities(image: np.ndarray, clip_percentiles, modalities=None) -> tuple[np.ndarray, dict]:
    """Per channel: clip to percentiles inside the brain mask, z-score there, background 0."""
    brain = np.any(image != 0, axis=0)
    out = np.zeros(image.shape, dtype=np.float32)
    low_p, high_p = (float(p) for p in clip_percentiles)
    names = list(modalities) if modalities is not None else [str(c) for c in range(image.shape[0])]
    stats = {}
    for channel, name in enumerate(names):
        values = image[channel][brain]
        low, high = np.percentile(values, [low_p, high_p])
        values = np.clip(values, low, high)
        mean = float(values.mean())
        std = float(values.std())
        scale = std if std > 1e-8 else 1.0  # a flat modality becomes all zeros rather than NaN
        out[channel][brain] = (values - mean) / scale
        stats[name] = {"clip": [float(low), float(high)], "mean": mean, "std": std}
    return out, stats


def resize_image(volume: np.ndarray, size) -> np.ndarray:
    """(C, X, Y, Z) float -> (C, *size) float32, trilinear with half-voxel (extent-aligned) centres: torch's
    `F.interpolate(mode="trilinear", align_corners=False)`, or its numpy form without torch (module docstring)."""
    if tuple(volume.shape[1:]) == tuple(size):
        return volume.astype(np.float32, copy=False)
    torch = sys.modules.get("torch")
    if torch is None:
        return np.stack([_trilinear_numpy(channel, size) for channel in np.asarray(volume, dtype=np.float32)])
    tensor = torch.from_numpy(np.ascontiguousarray(volume, dtype=np.float32))[None]
    return torch.nn.functional.interpolate(tensor, size=tuple(size), mode="trilinear", align_corners=False)[0].numpy()


def _trilinear_numpy(volume: np.ndarray, size) -> np.ndarray:
    """torch's CPU trilinear kernel on one (X, Y, Z) float32 volume: linear along Z, then Y, then X (its nesting)."""
    for axis in (2, 1, 0):
        volume = _linear_along(volume, axis, int(size[axis]))
    return volume


def _linear_along(volume: np.ndarray, axis: int, size: int) -> np.ndarray:
    """Linear interpolation along `axis` to `size` samples with torch's source index and weights (float32,
    `scale * (i + 0.5) - 0.5` clamped at 0). The two products are summed as torch's kernel does, with a fused
    multiply-add: in float64, where a float32 product is exact, rounded to float32 once."""
    length = volume.shape[axis]
    scale = np.float64(np.float32(length) / np.float32(size))
    source = np.maximum((scale * (np.arange(size, dtype=np.float64) + 0.5) - 0.5).astype(np.float32), np.float32(0))
    first = source.astype(np.int64)
    second = np.where(first < length - 1, first + 1, first)
    upper = np.clip(source - first.astype(np.float32), 0, 1).astype(np.float32)
    shape = [1] * volume.ndim
    shape[axis] = size
    high = np.take(volume, second, axis=axis)
    high *= upper.reshape(shape)
    low = np.take(volume, first, axis=axis).astype(np.float64)
    low *= (np.float32(1) - upper).astype(np.float64).reshape(shape)
    low += high
    return low.astype(np.float32)


def resize_label(label: np.ndarray, size) -> np.ndarray:
    """(X, Y, Z) integer labels -> size, nearest neighbour with centred sampling: torch's "nearest-exact", source
    index floor((i + 0.5) * scale) in float32, at most the last voxel (one indexing, as fast as torch's)."""
    if tuple(label.shape) == tuple(size):
        return label.astype(np.uint8, copy=False)
    index = []
    for length, want in zip(label.shape, size, strict=True):
        scale = np.float32(length) / np.float32(want)
        source = np.floor((np.arange(want, dtype=np.float32) + np.float32(0.5)) * scale).astype(np.int64)
        index.append(np.minimum(source, length - 1))
    return np.asarray(label, dtype=np.uint8)[np.ix_(*index)]


def pad_crop_offsets(box_shape, cube) -> list[int]:
    """Per axis, where box voxel 0 lands in the cube: centred, negative when the box is cropped."""
    return [(int(c) - int(s)) // 2 for s, c in zip(box_shape, cube, strict=True)]


def pad_crop(volume: np.ndarray, cube, offsets) -> np.ndarray:
    """Place a box (optionally with a leading channel axis) into a zero cube at `offsets`."""
    lead = volume.shape[: volume.ndim - 3]
    out = np.zeros((*lead, *cube), dtype=volume.dtype)
    src, dst = _overlap(volume.shape[-3:], cube, offsets)
    out[(..., *dst)] = volume[(..., *src)]
    return out


def unpad_crop(cube_volume: np.ndarray, box_shape, offsets, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `pad_crop`: the box part of a cube; voxels that were cropped away become 0 (or keep what
    `out`, the box to write into, holds there)."""
    lead = cube_volume.shape[: cube_volume.ndim - 3]
    if out is None:
        out = np.zeros((*lead, *box_shape), dtype=cube_volume.dtype)
    src, dst = _overlap(box_shape, cube_volume.shape[-3:], offsets)
    out[(..., *src)] = cube_volume[(..., *dst)]
    return out


def _overlap(box_shape, cube, offsets):
    src, dst = [], []
    for size, length, offset in zip(box_shape, cube, offsets, strict=True):
        start = max(0, -offset)
        stop = min(int(size), int(length) - offset)
        src.append(slice(start, stop))
        dst.append(slice(start + offset, stop + offset))
    return tuple(src), tuple(dst)


def to_original_grid(cube_label, meta: dict) -> np.ndarray:
    """A (D, H, W) label map in cube space -> uint8 on the original (X, Y, Z) grid (nearest); 0 outside
    the bounding box."""
    cube_label = _as_numpy(cube_label)
    _check_cube_shape(cube_label.shape, meta)
    box_shape = tuple(meta["bbox_shape"])
    if meta["fit"] == "resample":
        box_label = resize_label(cube_label, box_shape)
    else:
        box_label = unpad_crop(cube_label.astype(np.uint8, copy=False), box_shape, meta["pad_crop_offsets"])
    out = np.zeros(tuple(meta["original_shape"]), dtype=np.uint8)
    out[bbox_slices(meta["bbox"])] = box_label
    return out


def probabilities_to_original_grid(cube_probs, meta: dict, outside=None) -> np.ndarray:
    """(C, D, H, W) probabilities in cube space -> float32 (C, X, Y, Z) on the original grid (trilinear);
    where the cube holds nothing (outside the bounding box, and the parts of the box `pad_crop` cropped away)
    0, or per channel the values `outside` (a softmax's background channel: 1)."""
    cube_probs = _as_numpy(cube_probs).astype(np.float32, copy=False)
    if cube_probs.ndim != 4:
        raise ValueError(f"expected (C, D, H, W) probabilities, got shape {cube_probs.shape}")
    _check_cube_shape(cube_probs.shape[1:], meta)
    out = np.zeros((cube_probs.shape[0], *meta["original_shape"]), dtype=np.float32)
    if outside is not None:
        out[...] = np.asarray(outside, dtype=np.float32).reshape(-1, 1, 1, 1)
    box = out[(slice(None), *bbox_slices(meta["bbox"]))]  # a view: written in place
    if meta["fit"] == "resample":
        box[...] = resize_image(cube_probs, tuple(meta["bbox_shape"]))
    else:
        unpad_crop(cube_probs, tuple(meta["bbox_shape"]), meta["pad_crop_offsets"], out=box)
    return out


def header_from_meta(meta: dict) -> nib.Nifti1Header:
    """The source NIfTI header stored in `meta` (to write predictions with `save_label_nifti`)."""
    block = base64.b64decode(meta["header"])
    header_class = nib.Nifti2Header if len(block) == nib.Nifti2Header.template_dtype.itemsize else nib.Nifti1Header
    return header_class(binaryblock=block)


def _check_cube_shape(shape, meta: dict) -> None:
    if tuple(shape) != tuple(meta["cube"]):
        raise ValueError(f"case {meta.get('case_id')}: cube array of shape {tuple(shape)}, "
                         f"prepared cube is {tuple(meta['cube'])}")


def _as_numpy(array) -> np.ndarray:
    if hasattr(array, "detach"):  # a torch tensor (torch is not imported here: predicting without it)
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _label_counts(seg: np.ndarray) -> dict[str, int]:
    counts = np.bincount(seg.ravel())
    return {str(value): int(n) for value, n in enumerate(counts) if n and value}
