"""nnU-Net v2's inference rules, for runs imported from nnU-Net (`evaluate.inference: nnunet`).

An imported model predicts what `nnUNetv2_predict` predicts for the same files (tests/test_nnunet_predict.py
compares the two with nnunetv2 2.8.1 itself). The rules, in nnU-Net's order (its `DefaultPreprocessor`,
`nnUNetPredictor` and `export_prediction`):

1. Crop to the bounding box of the non-zero mask: voxels non-zero in any channel, holes filled
   (`create_nonzero_mask`: scipy's `binary_fill_holes`), no margin. The image stays float32 throughout.
2. Z-score each channel inside that mask (`ZScoreNormalization` with `use_mask_for_norm`); outside stays 0.
   Then, where the case's voxel size (its header's) is not the plans' spacing (`evaluate.resample_spacing`,
   written by import-nnunet), resample the crop to it (`nnunet_resampling`: order 3, separate z).
3. Pad the crop with zeros to at least the patch, centred with the odd voxel after (acvl_utils' `pad_nd_image`).
4. Tiles start where `compute_steps_for_sliding_window` says (`steps`): per axis ceil((size - patch) /
   (patch * step_size)) + 1 tiles, evenly spread from 0 to size - patch and rounded.
5. Each tile's logits are averaged over the mirrorings of `evaluate.mirror_axes` (the unflipped tile first,
   then the subsets of 1, 2, 3 axes), weighted by nnU-Net's Gaussian (`importance_map`: sigma = patch/8, peak
   10, rounded to float16, zeros raised to the smallest non-zero value) or by 1 (`--no-gaussian`), summed over
   tiles and divided by the summed weights; fold ensembles average these logits.
6. Logits predicted at the plans' spacing are resampled back to the crop's voxels (`nnunet_resampling`:
   order 1, float16 as nnU-Net's). Only then the nonlinearity and the labels, as nnU-Net's `LabelManager`
   (`apply_inference_nonlin`, then `convert_probabilities_to_segmentation`):
   - region-trained models (`model.outputs: regions`, nnU-Net's BraTS datasets): the sigmoid, then each region
     head in head order paints its label where its probability is above the threshold (0.5), later heads
     over earlier ones (`regions_class_order`). Outside the crop: probability 0, label 0.
   - label-trained models (`model.outputs: softmax`, nnU-Net's default): the softmax over the channels (in
     float32), then the argmax channel's label, the first channel on an exact tie (background 0;
     brats_swap.model.targets decodes it). The channels keep the model's order (`model.label_order`), so
     ties go where nnU-Net's go. Outside the crop: label 0, probability 1 in the background channel and 0
     in the others.

Why not MONAI's `sliding_window_inference`: it places tiles by its own scan interval (not nnU-Net's step
rule), builds its Gaussian with another normalisation and clamp, pads differently and blends whatever the
predictor returns; each changes nnU-Net's output. The pieces that are exact are reused: scipy for the hole
filling and the Gaussian (nnU-Net's own calls).

The rules run on numpy arrays whatever runs the network (`torch_logits`: a torch model on its device, under
autocast on CUDA as nnU-Net; `ship/onnx_runtime.py`: an onnxruntime session), so this module imports no torch
and predicting without it (`predict --runtime onnxruntime`) has the same code. numpy's float16 sums round as
torch's (each addition in float32, rounded to float16 once).

The sums are float16, as nnU-Net 2.8.1's (`predicted_logits` and `n_predictions`): a voxel that only
tile edges reach (tiny weights) gets its logit rounded coarsely, to 0 near the corners of a crop, exactly as
in nnU-Net; float32 sums would be more precise there but disagree with nnU-Net on those voxels. The input
is never rounded: the image stays float32 from the file to the network.

The tiles are visited in nnU-Net's order too, its loops nested over its own axes (`evaluate.nnunet_axes`), so
each voxel's float16 sum adds the same tiles in the same order: visited in brats-swap's (x, y, z) order, 1 voxel
in 10^5 of tests/test_nnunet_predict.py's phantoms flipped and the probabilities moved by 4e-6 on average; in
nnU-Net's order every label agrees and they move by 3e-8 (what is left is the network's float32 rounding on
permuted axes).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from brats_swap.errors import ConfigError, DataError
from brats_swap.evaluate import nnunet_resampling
from brats_swap.model.targets import probabilities_from_logits

NNUNET = "nnunet"  # the value of evaluate.inference that selects these rules
SIGMA_SCALE = 1.0 / 8  # nnU-Net's Gaussian: sigma = patch * 1/8
GAUSSIAN_PEAK = 10.0  # nnU-Net's value_scaling_factor (the map's maximum before the float16 rounding)
NORM_EPS = 1e-8  # ZScoreNormalization's floor of the standard deviation


def nonzero_crop(image: np.ndarray) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The bounding box [(start, stop)] per axis of the non-zero mask of a (C, X, Y, Z) image (any channel
    non-zero, holes filled), and that mask inside the box. DataError when every voxel is zero."""
    from scipy.ndimage import binary_fill_holes

    mask = np.any(image != 0, axis=0)
    mask = binary_fill_holes(mask)
    bbox = []
    for axis in range(mask.ndim):
        hits = np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))
        if hits.size == 0:
            raise DataError("every voxel of every modality is zero")
        bbox.append((int(hits[0]), int(hits[-1]) + 1))
    box = tuple(slice(a, b) for a, b in bbox)
    return bbox, mask[box]


def zscore_in_mask(image: np.ndarray, mask: np.ndarray, axes: Sequence[int] = (2, 1, 0)) -> np.ndarray:
    """(C, X, Y, Z) float32: each channel z-scored inside `mask`, nnU-Net's numpy operations in its order
    (float32 mean and std of the masked voxels), the voxels outside left as they are. The masked voxels are
    taken in the order of nnU-Net's axes (`axes`: `evaluate.nnunet_axes`), as its `image[mask]` lists them:
    numpy's float32 sums round by that order (on brats-swap's own order the mean and std can differ in their
    last bit, and every voxel with them)."""
    out = np.array(image, dtype=np.float32)  # a copy: the caller's case stays as loaded
    in_order = mask.transpose(axes)
    for channel in out:
        view = channel.transpose(axes)  # writes through to `channel`
        values = view[in_order]
        mean, std = values.mean(), values.std()
        view[in_order] = (values - mean) / max(std, NORM_EPS)
    return out


def compute_steps(image_size: Sequence[int], patch: Sequence[int], step_size: float) -> list[list[int]]:
    """Tile starts per axis: nnU-Net's `compute_steps_for_sliding_window` (same float operations)."""
    if not 0 < step_size <= 1:
        raise ConfigError(f"step size {step_size}: must be in (0, 1] (evaluate.sw_overlap = 1 - step size)")
    targets = [p * step_size for p in patch]
    counts = [int(np.ceil((i - k) / j)) + 1 for i, j, k in zip(image_size, targets, patch, strict=True)]
    steps = []
    for size, tile, count in zip(image_size, patch, counts, strict=True):
        stride = (size - tile) / (count - 1) if count > 1 else 0.0
        steps.append([int(np.round(stride * i)) for i in range(count)])
    return steps


@functools.lru_cache(maxsize=4)
def importance_map(patch: tuple[int, ...]) -> np.ndarray:
    """nnU-Net's `compute_gaussian(patch, 1/8, value_scaling_factor=10)`: a float16 map, zeros raised to the
    smallest non-zero weight (read-only: the cache's one copy)."""
    from scipy.ndimage import gaussian_filter

    delta = np.zeros(patch)
    delta[tuple(p // 2 for p in patch)] = 1
    weights = gaussian_filter(delta, [p * SIGMA_SCALE for p in patch], 0, mode="constant", cval=0)
    weights /= np.max(weights) / GAUSSIAN_PEAK
    half = weights.astype(np.float16)
    zero = half == 0
    half[zero] = np.min(half[~zero])
    half.flags.writeable = False
    return half


def pad_to_patch(image: np.ndarray, patch: Sequence[int]) -> tuple[np.ndarray, tuple[slice, ...]]:
    """Zero-pad the spatial axes of (C, X, Y, Z) to at least `patch`, centred (the odd voxel after), as
    acvl_utils' `pad_nd_image`; returns the padded image and the slices of the original inside it."""
    below, above, keep = [], [], []
    for size, tile in zip(image.shape[1:], patch, strict=True):
        extra = max(int(tile) - int(size), 0)
        below.append(extra // 2)
        above.append(extra - extra // 2)
        keep.append(slice(extra // 2, extra // 2 + int(size)))
    if not any(below) and not any(above):
        return image, tuple(keep)
    return np.pad(image, [(0, 0), *zip(below, above, strict=True)]), tuple(keep)


def mirror_combinations(axes: Sequence[int]) -> list[tuple[int, ...]]:
    """nnU-Net's order: no flip, then every subset of 1, 2, ... of `axes` (axes of the (B, C, X, Y, Z) batch)."""
    return [(), *(c for n in range(1, len(axes) + 1) for c in itertools.combinations(tuple(axes), n))]


def mirrored_logits(logits_of: Callable[[np.ndarray], np.ndarray], tiles: np.ndarray,
                    axes: Sequence[int]) -> np.ndarray:
    """nnU-Net's `_internal_maybe_mirror_and_predict`: the mean of flip(net(flip(x))) over the mirrorings,
    summed in float32 in nnU-Net's order. `axes` are spatial (0, 1, 2)."""
    combos = mirror_combinations([a + 2 for a in axes])
    total = np.array(logits_of(tiles), dtype=np.float32)
    for flip in combos[1:]:
        total += np.flip(logits_of(np.ascontiguousarray(np.flip(tiles, flip))), flip).astype(np.float32)
    if len(combos) > 1:
        total /= np.float32(len(combos))
    return total


def sliding_window_logits(logits_of: Callable[[np.ndarray], np.ndarray], image: np.ndarray,
                          patch: Sequence[int], out_channels: int, *, step_size: float = 0.5, gaussian: bool = True,
                          mirror_axes: Sequence[int] = (), batch_size: int = 1,
                          tile_order: Sequence[int] = (0, 1, 2)) -> np.ndarray:
    """(K, X, Y, Z) float16 logits of a (C, X, Y, Z) image, nnU-Net's sliding window (module docstring, 3-5).
    `batch_size` tiles go through the network at once (each tile's logits are the same as alone: the network
    normalises per instance). Tiles are visited with their loops nested over the axes in `tile_order`,
    outermost first: nnU-Net's own axis order (`evaluate.nnunet_axes`), so that each voxel's float16 sum adds
    its tiles in nnU-Net's order."""
    patch = tuple(int(p) for p in patch)
    padded, keep = pad_to_patch(np.asarray(image, dtype=np.float32), patch)
    spatial = tuple(padded.shape[1:])
    steps, order = compute_steps(spatial, patch, step_size), tuple(int(a) for a in tile_order)  # checked by the config loader
    starts = [tuple(combo[order.index(axis)] for axis in range(3))
              for combo in itertools.product(*(steps[axis] for axis in order))]
    weights = importance_map(patch) if gaussian else None
    # float16 sums, as nnU-Net's `predicted_logits` and `n_predictions` (module docstring).
    total = np.zeros((out_channels, *spatial), dtype=np.float16)
    norm = np.zeros(spatial, dtype=np.float16)
    for first in range(0, len(starts), batch_size):
        chunk = starts[first:first + batch_size]
        boxes = [tuple(slice(s, s + p) for s, p in zip(start, patch, strict=True)) for start in chunk]
        tiles = np.stack([padded[(slice(None), *box)] for box in boxes])
        logits = mirrored_logits(logits_of, tiles, mirror_axes)
        if weights is not None:
            logits *= weights  # float32 logits times the float16 weights, in float32 (as nnU-Net)
        for index, box in enumerate(boxes):
            total[(slice(None), *box)] += logits[index]
            norm[box] += weights if weights is not None else np.float16(1)
    with np.errstate(over="ignore"):
        np.divide(total, norm, out=total)
    if np.isinf(total).any():  # nnU-Net aborts here too: a float16 sum overflowed
        raise DataError("the blended logits overflow float16 (as nnU-Net's would); predict with "
                        "--set evaluate.inference=brats_swap")
    return total[(slice(None), *keep)]


def network_logits(model) -> Callable:
    """The model's full-resolution logits (brats_swap.model.networks' `logits`, or an onnxruntime network
    exported with its logits); ConfigError for a network that ends in a sigmoid (its logits are not there to
    blend)."""
    logits = getattr(model, "logits", None)
    if logits is None:
        raise ConfigError(f"evaluate.inference={NNUNET}: {type(model).__name__} returns probabilities, not logits; "
                          "nnU-Net's rules blend logits (use evaluate.inference=brats_swap)")
    return logits


def torch_logits(model, device) -> Callable[[np.ndarray], np.ndarray]:
    """A torch model's logits (`network_logits`) on numpy tiles, run on `device`: under autocast on CUDA (float16
    convolutions, as nnU-Net runs its network there), in float32 elsewhere; float32 on the host."""
    import torch

    logits = network_logits(model)
    model.eval()

    @torch.inference_mode()
    def predict(tiles: np.ndarray) -> np.ndarray:
        with torch.autocast("cuda") if device.type == "cuda" else contextlib.nullcontext():
            return logits(torch.from_numpy(tiles).to(device)).float().cpu().numpy()

    return predict


def array_logits(model, device) -> Callable[[np.ndarray], np.ndarray]:
    """The logits of a member's network on numpy tiles: an onnxruntime network's own (`ship/onnx_runtime.py`),
    a torch model's on `device` (`torch_logits`)."""
    if getattr(model, "runs_on_arrays", False):
        return network_logits(model)
    return torch_logits(model, device)


def case_logits(members: Sequence[tuple[object, object]], image: np.ndarray, device, *, tta: bool,
                spacing: Sequence[float] | None = None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One case's logits in its non-zero crop, the mean over the members (a fold ensemble, as nnU-Net averages
    its folds' logits), and the crop's bounding box. `image`: (C, X, Y, Z) as loaded (float32, unrounded);
    `spacing`: its voxel size in mm, with which the crop is resampled to the members' `evaluate.resample_spacing`
    and the logits back (`nnunet_resampling`)."""
    bbox, mask = nonzero_crop(image)
    box = tuple(slice(a, b) for a, b in bbox)
    normalised = zscore_in_mask(image[(slice(None), *box)], mask, members[0][1].evaluate.nnunet_axes)
    resampling = nnunet_resampling.case_resampling(normalised.shape[1:], spacing, nnunet_resampling.target_grid(members),
                                                   normalised.shape[0], int(members[0][0].out_channels))
    cropped = normalised if resampling is None else resampling.image(normalised)
    total = None
    for model, config in members:
        evaluate = config.evaluate
        logits = sliding_window_logits(
            array_logits(model, device), cropped, config.train.patch, int(model.out_channels),
            step_size=step_size_of(evaluate.sw_overlap), gaussian=evaluate.sw_blend == "gaussian",
            mirror_axes=evaluate.mirror_axes if tta else (), batch_size=evaluate.sw_batch_size,
            tile_order=evaluate.nnunet_axes)
        total = logits if total is None else np.add(total, logits, out=total)  # float16, as nnU-Net sums its folds
    if len(members) > 1:
        total /= np.float16(len(members))
    if resampling is not None:
        total = resampling.logits_back(total)
    return total, bbox


def step_size_of(sw_overlap: float) -> float:
    """nnU-Net's step size (a fraction of the patch) for `evaluate.sw_overlap`: 1 - overlap, rounded to 10
    decimals so that --step-size 0.3 gives 0.3 back, not 0.30000000000000004 (whose steps could differ)."""
    return round(1.0 - float(sw_overlap), 10)


def crop_probabilities(members: Sequence[tuple[object, object]], image: np.ndarray, device, *, tta: bool,
                       spacing: Sequence[float] | None = None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(K, ...) float32 probabilities inside the case's non-zero crop (sigmoid, or softmax across the channels
    for `model.outputs: softmax`, of the float16 logits made float32 first, as nnU-Net), and the crop's
    bounding box."""
    logits, bbox = case_logits(members, image, device, tta=tta, spacing=spacing)
    return probabilities_from_logits(logits.astype(np.float32), members[0][1].model.outputs, channel_dim=0), bbox


def on_case_grid(crop: np.ndarray, bbox: Sequence[tuple[int, int]], shape: Sequence[int],
                 outside: Sequence[float] | None = None) -> np.ndarray:
    """A crop's array (with leading axes, if any) placed on the case's grid of `shape`; outside the crop 0, or
    per channel the values `outside` (a softmax's background: `targets.background_probabilities`)."""
    out = np.zeros((*crop.shape[:crop.ndim - 3], *shape), dtype=crop.dtype)
    if outside is not None:
        out[...] = np.asarray(outside, dtype=crop.dtype).reshape(-1, *(1,) * len(shape))
    out[(..., *(slice(a, b) for a, b in bbox))] = crop
    return out


def region_labels(probs: np.ndarray, own_labels: Sequence[int], threshold: float = 0.5) -> np.ndarray:
    """uint8 labels from (K, X, Y, Z) region probabilities: head k paints `own_labels[k]` where its probability
    is above `threshold`, in head order (nnU-Net's `convert_probabilities_to_segmentation` for regions)."""
    labels = np.zeros(probs.shape[1:], dtype=np.uint8)
    for channel, value in zip(probs, own_labels, strict=True):
        labels[channel > threshold] = value
    return labels
