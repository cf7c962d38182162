"""The inference rules of brats-swap's own models on numpy arrays, whatever runs the network: the whole cube in
one call or MONAI's sliding window, the mirrorings of test-time augmentation, the fold ensemble.

`run/inference.py` runs them with a torch network (validation, evaluation, `predict --runtime torch`) and
`ship/onnx_runtime.py` with an onnxruntime session (`predict --runtime onnxruntime`): this module imports
neither torch nor MONAI, so a process that predicts without them has the same code as one that trains.

A network here is a callable from a (B, C_in, ...) float32 batch to (B, C, ...) float32 probabilities.

- Sliding window: MONAI 1.6's `sliding_window_inference` (what brats-swap's patch models have always predicted
  with), its rules in numpy: inputs smaller than the window zero-padded, centred (the odd voxel after); per axis
  a scan interval of int(window x (1 - overlap)) (the whole window where it fits the image exactly), windows
  at multiples of it, the last moved back inside the image; windows visited in C order, `sw_batch_size` per call;
  each window's output times the importance map (MONAI's Gaussian, the product of exp(-x²/2σ²) per axis with
  σ = window/8 and x from the window's centre, floored at max(its minimum, 1e-3); or ones), summed in float32
  in window order with the map's sums, then divided. tests/test_onnx.py compares it with MONAI's.
- Mirroring (`tta`): nnU-Net's 8 flips of the 3 spatial axes (the subsets of `evaluate.mirror_axes`); each
  output flipped back and summed in float64, rounded to float32 once (flip-equivariant by construction).
- Fold ensembles: the mean of each fold's probabilities (with its own window and mirrors), summed in float64.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

ArrayNetwork = Callable[[np.ndarray], np.ndarray]
# The spatial axes of a (B, C, D, H, W) batch, mirrored by test-time augmentation.
MIRROR_AXES: tuple[int, ...] = (2, 3, 4)
SIGMA_SCALE = 0.125  # MONAI's default: sigma = window / 8
MIN_WEIGHT = 1e-3  # MONAI's floor of the Gaussian importance map


def mirror_subsets(axes: Sequence[int] = MIRROR_AXES) -> list[tuple[int, ...]]:
    """Every subset of `axes`, the empty one first: 8 for the 3 spatial axes."""
    return [subset for size in range(len(axes) + 1) for subset in itertools.combinations(tuple(axes), size)]


def mirrored(predict: ArrayNetwork, images: np.ndarray, axes: Sequence[int] = MIRROR_AXES) -> np.ndarray:
    """The mean of `flip_S(predict(flip_S(images)))` over every subset S of `axes` (module docstring)."""
    subsets = mirror_subsets(axes)
    total: np.ndarray | None = None
    for subset in subsets:
        flipped = np.ascontiguousarray(np.flip(images, subset)) if subset else images
        probs = predict(flipped)
        probs = (np.flip(probs, subset) if subset else probs).astype(np.float64)
        total = probs if total is None else np.add(total, probs, out=total)
    return (total / len(subsets)).astype(np.float32)


def importance_map(window: Sequence[int], blend: str) -> np.ndarray:
    """MONAI's `compute_importance_map` (float32): its Gaussian (module docstring) or ones for "constant"."""
    if blend == "constant":
        return np.ones(tuple(window), dtype=np.float32)
    weights: np.ndarray | None = None
    for size in window:
        x = np.arange(-(size - 1) / 2.0, (size - 1) / 2.0 + 1, dtype=np.float32)
        profile = np.exp(x**2 / np.float32(-2 * (size * SIGMA_SCALE) ** 2)).astype(np.float32)
        weights = profile if weights is None else weights[..., None] * profile
    return np.maximum(weights, max(float(weights.min()), MIN_WEIGHT)).astype(np.float32)


def window_starts(image_size: Sequence[int], window: Sequence[int], overlap: float) -> list[tuple[int, ...]]:
    """MONAI's window corners (`_get_scan_interval`, `dense_patch_slices`), in its order."""
    starts = []
    for size, length in zip(image_size, window, strict=True):
        interval = length if length == size else max(int(length * (1 - overlap)), 1)
        count = next((d + 1 for d in range(math.ceil(size / interval)) if d * interval + length >= size), 1)
        starts.append([index * interval - max(index * interval + length - size, 0) for index in range(count)])
    return list(itertools.product(*starts))


def sliding_window(predict: ArrayNetwork, images: np.ndarray, window: Sequence[int], *, overlap: float,
                   blend: str = "gaussian", batch_size: int = 1) -> np.ndarray:
    """(B, C_in, ...) -> (B, C, ...) float32 probabilities by MONAI's sliding window (module docstring).

    A network with a `sliding_window` method of its own (the torch one, `run/inference.TorchNetwork`) runs it
    there: MONAI itself, with the volume moved to the device once or the window copies overlapped; this numpy
    copy of MONAI's rule is what onnxruntime runs (the two agree to 1e-6, tests/test_onnx.py)."""
    own = getattr(predict, "sliding_window", None)
    if own is not None:
        return own(images, window, overlap=overlap, blend=blend, batch_size=batch_size)
    images = np.asarray(images, dtype=np.float32)
    window = tuple(int(w) for w in window)
    pads = [(0, 0), (0, 0)]
    for size, length in zip(images.shape[2:], window, strict=True):
        extra = max(length - size, 0)
        pads.append((extra // 2, extra - extra // 2))
    padded = np.pad(images, pads) if any(p for pair in pads for p in pair) else images
    spatial = padded.shape[2:]
    boxes = [tuple(slice(s, s + w) for s, w in zip(start, window, strict=True))
             for start in window_starts(spatial, window, overlap)]
    weights = importance_map(window, blend)
    calls = [(b, box) for b in range(padded.shape[0]) for box in boxes]
    output: np.ndarray | None = None
    count = np.zeros(spatial, dtype=np.float32)
    for box in boxes:
        count[box] += weights
    for first in range(0, len(calls), batch_size):
        chunk = calls[first:first + batch_size]
        probs = predict(np.ascontiguousarray(np.stack([padded[(b, slice(None), *box)] for b, box in chunk])))
        if output is None:
            output = np.zeros((padded.shape[0], probs.shape[1], *spatial), dtype=np.float32)
        for (b, box), prob in zip(chunk, probs, strict=True):
            output[(b, slice(None), *box)] += prob.astype(np.float32) * weights
    output /= count
    keep = tuple(slice(below, below + size) for (below, _), size in zip(pads[2:], images.shape[2:], strict=True))
    return output[(slice(None), slice(None), *keep)]


def probabilities(predict: ArrayNetwork, images: np.ndarray, config, *, tta: bool = False) -> np.ndarray:
    """One model's probabilities of a (B, C_in, D, H, W) batch as its config says: the whole cube for `full`,
    the sliding window over `train.patch` for `patch`; with `tta`, averaged over `evaluate.mirror_axes`'
    mirrorings."""
    evaluate = config.evaluate

    def once(batch: np.ndarray) -> np.ndarray:
        if config.train.mode == "patch":
            return sliding_window(predict, batch, config.train.patch, overlap=evaluate.sw_overlap,
                                  blend=evaluate.sw_blend, batch_size=evaluate.sw_batch_size)
        return np.asarray(predict(batch), dtype=np.float32)

    axes = tuple(2 + a for a in evaluate.mirror_axes)  # the spatial axes of the (B, C, D, H, W) batch
    return mirrored(once, images, axes) if tta else once(images)


def ensemble(members: Sequence[tuple[ArrayNetwork, object]], images: np.ndarray, *, tta: bool = False) -> np.ndarray:
    """The mean probabilities of several models (a fold ensemble), each predicting as its own config says
    (`probabilities`), summed in float64 like the mirrorings."""
    if not members:
        raise ValueError("ensemble: no model to predict with")
    total: np.ndarray | None = None
    for predict, config in members:
        probs = probabilities(predict, images, config, tta=tta).astype(np.float64)
        total = probs if total is None else np.add(total, probs, out=total)
    return (total / len(members)).astype(np.float32)
