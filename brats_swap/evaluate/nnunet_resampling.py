"""nnU-Net 2.8.1's resampling, for runs imported from nnU-Net (`evaluate.inference: nnunet`).

nnU-Net predicts at its plans' spacing: `DefaultPreprocessor.run_case_npy` resamples the cropped, normalised
image to the plans' 3d_fullres `spacing` before the sliding window, and `export_prediction` resamples the
logits back to the crop's shape before the sigmoid. Both call `resample_data_or_seg_to_shape` (the plans'
`resampling_fn_data`, order 3, and `resampling_fn_probabilities`, order 1; both with order_z 0 and
force_separate_z None, the only ones import-nnunet accepts). Its rules, reproduced here in its order:

1. The new shape, per axis: int(round(old spacing / new spacing * old size)) (`compute_new_shape`).
2. Separate z (`determine_do_sep_z_and_axis`): when the grid resampled from has one coarsest axis and its
   spacing is more than ANISO_THRESHOLD (3) times the finest, that axis; else the same test on the grid
   resampled to; else none. Two or three equally coarse axes: none.
3. Without separate z: each channel, as float64, resized in 3D as skimage's `resize(order, mode='edge',
   anti_aliasing=False)` does it: scipy's `zoom(grid_mode=True, mode='nearest')` (a B-spline of `order`
   through the voxel centres, the grid's outer edges kept in place), then clipped to the channel's own
   minimum and maximum.
4. With separate z: each slice across that axis resized in 2D the same way, then, along the axis, the
   nearest slice (order_z 0: `map_coordinates(order=0, mode='nearest')` at scale * (i + 0.5) - 0.5).
5. The result in the input's dtype (the image float32, the logits float16 as nnU-Net's sums); the input
   itself when the shape does not change.

skimage is not a dependency of brats-swap: its `resize` is these two scipy calls, written out (and tested
equal to nnU-Net's own function, tests/test_nnunet_resampling.py). Why not MONAI's `Spacing`/`Resize` or
torch's `interpolate`: torch has no 3D cubic mode and its 2D bicubic is a cubic convolution, not a B-spline
with its prefilter, it interpolates float32 and clips nothing; MONAI's `Resize` is torch's interpolate, and
its `Spacing` derives the output grid from the affine by its own rule, not nnU-Net's rounding of old spacing /
new spacing x size. Each changes nnU-Net's voxels.

Axis order: brats-swap keeps the file's (x, y, z), nnU-Net works on SimpleITK's (z, y, x) after the plans'
`transpose_forward` (`evaluate.nnunet_axes`, written by import-nnunet). Each rule above is per axis, but scipy
sums the spline's terms axis after axis: in another axis order the float64 results differ in their last
bits, and a linear interpolation of float16 logits often lands exactly halfway between two float16 values,
where those bits decide the rounding (measured: 1 float16 step on about 0.1% of the voxels). So the arrays
are resampled on nnU-Net's axes (a transposed view) and transposed back: the same bits as nnU-Net's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from brats_swap.config.host import available_host_bytes
from brats_swap.config.schema import INTEGER_LIMITS
from brats_swap.errors import ConfigError, DataError

ANISO_THRESHOLD = 3  # nnunetv2.configuration.ANISO_THRESHOLD
IMAGE_ORDER = 3  # the plans' resampling_fn_data_kwargs order
LOGITS_ORDER = 1  # the plans' resampling_fn_probabilities_kwargs order
# The most voxels a case may have along an axis at the plans' spacing: data.cube's limit, the largest volume
# edge brats-swap takes anywhere (a hostile spacing of 1e-6 mm would ask for millions).
MAX_AXIS = INTEGER_LIMITS["data.cube"]


def compute_new_shape(shape: Sequence[int], spacing: Sequence[float], new_spacing: Sequence[float]) -> tuple[int, ...]:
    """nnU-Net's `compute_new_shape`: the shape of `shape` voxels of `spacing` mm resampled to `new_spacing`.
    ValueError when an axis would have 0 or more than MAX_AXIS voxels (or more than a float holds)."""
    sizes = [i / j * k for i, j, k in zip(spacing, new_spacing, shape, strict=True)]
    if not all(math.isfinite(v) and 0 < round(v) <= MAX_AXIS for v in sizes):
        raise ValueError(f"gives {', '.join(f'{v:.4g}' for v in sizes)} voxels; each axis must have 1 to {MAX_AXIS}")
    return tuple(int(round(v)) for v in sizes)


def separate_z_axis(spacing: Sequence[float], new_spacing: Sequence[float],
                    threshold: float = ANISO_THRESHOLD) -> int | None:
    """The axis resampled apart (nearest slice), as nnU-Net's `determine_do_sep_z_and_axis` with
    force_separate_z None decides it; None: resample in 3D."""
    for grid in (spacing, new_spacing):
        if np.max(grid) / np.min(grid) > threshold:
            coarsest = np.where(max(grid) / np.array(grid) == 1)[0]
            return int(coarsest[0]) if len(coarsest) == 1 else None
    return None


def resample(data: np.ndarray, shape: Sequence[int], spacing: Sequence[float], new_spacing: Sequence[float],
             order: int) -> np.ndarray:
    """(C, ...) `data` of `spacing` mm resampled to `shape` (of `new_spacing` mm), nnU-Net's
    `resample_data_or_seg_to_shape(data, shape, spacing, new_spacing, is_seg=False, order=order, order_z=0,
    force_separate_z=None)`: the module docstring's rules 2-5."""
    shape = tuple(int(s) for s in shape)
    if tuple(data.shape[1:]) == shape:
        return data
    axis = separate_z_axis(spacing, new_spacing)
    out = np.zeros((data.shape[0], *shape), dtype=data.dtype)
    for channel, target in zip(data, out, strict=True):
        values = channel.astype(np.float64)  # nnU-Net resamples in float64 (data.astype(float))
        target[...] = _resize(values, shape, order) if axis is None else _resize_apart(values, shape, axis, order)
    return out


def _resize(values: np.ndarray, shape: Sequence[int], order: int) -> np.ndarray:
    """skimage's `resize(values, shape, order, mode='edge', anti_aliasing=False)` of float64 `values`: scipy's
    zoom on the voxel-centre grid, then clipped to the input's range (skimage's `_clip_warp_output`)."""
    from scipy.ndimage import zoom

    factors = np.divide(values.shape, shape)
    out = zoom(values, [1 / f for f in factors], order=order, mode="nearest", grid_mode=True)
    low = np.min(values)
    low, high = (np.nanmin(values), np.nanmax(values)) if np.isnan(low) else (low, np.max(values))
    np.clip(out, np.asarray(low), np.asarray(high), out=out)
    return out


def _resize_apart(values: np.ndarray, shape: Sequence[int], axis: int, order: int) -> np.ndarray:
    """nnU-Net's separate-z resampling of one float64 channel: each slice across `axis` resized in 2D, then
    the nearest slice along `axis` (order_z 0)."""
    in_plane = [size for a, size in enumerate(shape) if a != axis]
    slices = np.stack([_resize(np.take(values, index, axis=axis), in_plane, order)
                       for index in range(values.shape[axis])], axis=axis)
    if values.shape[axis] == shape[axis]:
        return slices
    return np.take(slices, nearest_slices(values.shape[axis], shape[axis]), axis=axis)


def nearest_slices(size: int, new_size: int) -> np.ndarray:
    """For each of `new_size` slices, the one of `size` that nnU-Net's `map_coordinates(..., order=0,
    mode='nearest')` picks, with nnU-Net's coordinates (scale * (i + 0.5) - 0.5). Its 3D call picks along
    each axis independently; along the others the coordinates are the slices' own, so asking scipy for the
    indices in 1D picks the same slices without nnU-Net's three float64 coordinate volumes."""
    from scipy.ndimage import map_coordinates

    scale = float(size) / new_size
    coordinates = scale * (np.arange(new_size) + 0.5) - 0.5
    picked = map_coordinates(np.arange(size, dtype=np.float64), coordinates[None], order=0, mode="nearest")
    return picked.astype(np.intp)


@dataclass(frozen=True)
class CaseResampling:
    """One case's way to the plans' spacing and back: its crop's shape and spacing (mm), the shape and spacing
    the network predicts at (all on brats-swap's axes), and nnU-Net's axis order (`evaluate.nnunet_axes`)."""

    crop_shape: tuple[int, ...]
    case_spacing: tuple[float, ...]
    shape: tuple[int, ...]
    spacing: tuple[float, ...]
    axes: tuple[int, ...] = (2, 1, 0)

    def image(self, image: np.ndarray) -> np.ndarray:
        """The normalised (C, ...) float32 crop at the plans' spacing (nnU-Net's `resampling_fn_data`)."""
        return self._in_nnunets_order(image, self.shape, self.case_spacing, self.spacing, IMAGE_ORDER)

    def logits_back(self, logits: np.ndarray) -> np.ndarray:
        """(K, ...) float16 logits back on the crop's voxels (nnU-Net's `resampling_fn_probabilities`)."""
        return self._in_nnunets_order(logits, self.crop_shape, self.spacing, self.case_spacing, LOGITS_ORDER)

    def _in_nnunets_order(self, data: np.ndarray, shape: Sequence[int], spacing: Sequence[float],
                          new_spacing: Sequence[float], order: int) -> np.ndarray:
        """`resample` on nnU-Net's axes (module docstring: the order of the float64 sums), back on brats-swap's."""
        forward = (0, *(1 + a for a in self.axes))
        out = resample(data.transpose(forward), [shape[a] for a in self.axes], [spacing[a] for a in self.axes],
                       [new_spacing[a] for a in self.axes], order)
        return np.ascontiguousarray(out.transpose(np.argsort(forward)))


def target_grid(members: Sequence[tuple[object, object]]) -> tuple[tuple[float, ...], tuple[int, ...]] | None:
    """The members' `evaluate.resample_spacing` and `evaluate.nnunet_axes` (None: the case's own voxels);
    ConfigError when folds differ (nnU-Net's folds share one plans file)."""
    grids = {(None if c.evaluate.resample_spacing is None else tuple(c.evaluate.resample_spacing),
              tuple(c.evaluate.nnunet_axes)) for _, c in members}
    if len(grids) > 1:
        raise ConfigError(f"the folds predict at different evaluate.resample_spacing / nnunet_axes ({sorted(map(str, grids))}); "
                          "predict with one of them (--folds K)")
    spacing, axes = grids.pop()
    return None if spacing is None else (spacing, axes)


def case_resampling(crop_shape: Sequence[int], case_spacing: Sequence[float] | None,
                    grid: tuple[Sequence[float], Sequence[int]] | None, channels: int, out_channels: int,
                    available: int | None = None) -> CaseResampling | None:
    """How one case's crop is resampled to `grid` (`target_grid`; None: not at all, as when the shape stays),
    priced before anything is allocated: DataError (one line) for a spacing the header gives that is not a
    positive number, a resampled crop with an axis of 0 or more than MAX_AXIS voxels, or one the host's memory
    cannot hold."""
    if grid is None or case_spacing is None:
        return None
    case_spacing = tuple(abs(float(s)) for s in case_spacing)  # nnU-Net takes the header's spacing's abs too
    if not all(math.isfinite(s) and s > 0 for s in case_spacing):
        raise DataError(f"the header's voxel size {list(case_spacing)} mm is not 3 positive numbers; nnU-Net's "
                        "resampling needs it")
    crop_shape, spacing = tuple(int(s) for s in crop_shape), tuple(float(s) for s in grid[0])
    where = (f"resampling the crop {list(crop_shape)} of {list(case_spacing)} mm to evaluate.resample_spacing "
             f"{list(spacing)} mm (the nnU-Net plans' spacing)")
    try:
        shape = compute_new_shape(crop_shape, case_spacing, spacing)
    except ValueError as exc:
        raise DataError(f"{where} {exc}") from None
    if shape == crop_shape:
        return None
    needed = resampled_bytes(shape, channels, out_channels)
    available = available_host_bytes() if available is None else available
    if available is not None and needed > available:
        raise DataError(f"{where} gives {list(shape)} voxels, which need {needed / 2**30:.3g} GiB of host memory; "
                        f"{available / 2**30:.3g} GiB is available")
    return CaseResampling(crop_shape, case_spacing, shape, spacing, tuple(int(a) for a in grid[1]))


def resampled_bytes(shape: Sequence[int], channels: int, out_channels: int) -> int:
    """Host bytes of a case at the plans' spacing: the float32 image and its zero-padded copy, one channel in
    float64 while it is resized, the float16 logit sums and their copy, the float16 weights, and one logit
    channel in float64 on its way back."""
    return math.prod(shape) * (2 * channels * 4 + 8 + 2 * out_channels * 2 + 2 + 8)
