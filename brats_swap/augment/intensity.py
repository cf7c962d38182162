"""The intensity transforms, batched over (sample, channel) pairs.

Every function takes the batch (B, C, X, Y, Z) and the chosen (sample, channel) pairs as flat indices
(sample * C + channel) with their values, worked out on the host from the parameters so that choosing them
never waits for the device; only the chosen channels are gathered, transformed together and written back
in place. The arithmetic is batchgeneratorsv2's for each transform (GaussianNoise,
GaussianBlur, MultiplicativeBrightness, Contrast with preserve_range, SimulateLowResolution, Gamma with
retain_stats, BrightnessAdditive), so one channel's result equals that library's within float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_EPS = 1e-7  # batchgeneratorsv2's gamma epsilon


def chosen_channels(values: Sequence[Sequence], neutral) -> tuple[list[int], list]:
    """Flat (sample * C + channel) indices of the per-sample, per-channel `values` that are not `neutral`,
    and those values."""
    index, chosen = [], []
    for b, row in enumerate(values):
        for c, value in enumerate(row):
            if value != neutral:
                index.append(b * len(row) + c)
                chosen.append(value)
    return index, chosen


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-channel values as a (n, 1, 1, 1) tensor on `like`'s device and dtype."""
    return torch.tensor(values, device=like.device, dtype=like.dtype).view(-1, 1, 1, 1)


def _view(images: torch.Tensor) -> torch.Tensor:
    return images.view(-1, *images.shape[2:])


def add_noise(images: torch.Tensor, stds: Sequence[float], seeds: Sequence[int]) -> None:
    """Per sample, one std for all channels (synchronize_channels=True); the noise image comes from the
    sample's own generator on the images' device, drawn as batchgeneratorsv2 draws it (normal_(0, std) over
    (C, X, Y, Z))."""
    for b, (std, seed) in enumerate(zip(stds, seeds, strict=True)):
        if std == 0.0:
            continue
        generator = torch.Generator(device=images.device).manual_seed(seed)
        noise = torch.empty(images.shape[1:], device=images.device, dtype=images.dtype)
        images[b] += noise.normal_(0.0, std, generator=generator)


def _kernel_size(sigma: float, truncate: float = 6.0) -> int:
    # batchgeneratorsv2's _compute_kernel_size with blur_dimension's truncate=6: round(sigma * 6 + 0.5) to the
    # nearest odd number (Python's round, ties to even, as there).
    n = sigma * truncate + 0.5
    rounded = round(n)
    if rounded % 2 == 1:
        return rounded
    return rounded + 1 if n - rounded >= 0 else rounded - 1


def _kernels(sigmas: Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """sigmas -> (n, K) normalised Gaussian taps, each zero outside its own kernel size, K the largest."""
    sizes = [_kernel_size(s) for s in sigmas]
    width = max(sizes)
    x = torch.arange(width, device=device, dtype=torch.float32) - (width - 1) / 2
    half = torch.tensor([(s - 1) / 2 for s in sizes], device=device, dtype=torch.float32)
    sigma = torch.tensor(sigmas, device=device, dtype=torch.float32)
    pdf = torch.exp(-0.5 * (x[None] / sigma[:, None]) ** 2) * (x[None].abs() <= half[:, None])
    return (pdf / pdf.sum(1, keepdim=True)).to(dtype)


def blur(images: torch.Tensor, index: Sequence[int], sigmas: Sequence[Sequence[float]]) -> None:
    """Separable Gaussian blur with reflect padding of the chosen channels, sigmas per axis. Kernels of
    different sizes share one grouped convolution per axis: a kernel zero-padded to the largest size reads
    the same reflected voxels with the same weights."""
    if not index:
        return
    flat = _view(images)
    rows = torch.tensor(index, device=images.device)
    sub = flat[rows][None]  # (1, n, X, Y, Z)
    for axis in range(3):
        kernels = _kernels([s[axis] for s in sigmas], images.device, images.dtype)
        width = kernels.shape[1]
        shape = [1, 1, 1]
        shape[axis] = width
        pad = [0, 0, 0, 0, 0, 0]
        pad[4 - 2 * axis] = pad[5 - 2 * axis] = width // 2
        padded = F.pad(sub, pad, mode="reflect")
        sub = F.conv3d(padded, kernels.view(-1, 1, *shape), groups=kernels.shape[0])
    flat.index_copy_(0, rows, sub[0])


def multiply(images: torch.Tensor, factors: Sequence[Sequence[float]]) -> None:
    """Multiplicative brightness: each channel times its factor (1 = none)."""
    images.mul_(torch.tensor(factors, device=images.device, dtype=images.dtype)[..., None, None, None])


def add(images: torch.Tensor, shifts: Sequence[Sequence[float]]) -> None:
    """Additive brightness: each channel plus its shift (0 = none)."""
    images.add_(torch.tensor(shifts, device=images.device, dtype=images.dtype)[..., None, None, None])


def contrast(images: torch.Tensor, index: Sequence[int], factors: Sequence[float]) -> None:
    """(x - mean) * factor + mean, clamped to the channel's original min and max (preserve_range)."""
    if not index:
        return
    flat = _view(images)
    rows = torch.tensor(index, device=images.device)
    sub = flat[rows]
    dims = tuple(range(1, sub.ndim))
    mean = sub.mean(dims, keepdim=True)
    low, high = sub.amin(dims, keepdim=True), sub.amax(dims, keepdim=True)
    sub = torch.minimum(torch.maximum((sub - mean) * _column(factors, sub) + mean, low), high)
    flat.index_copy_(0, rows, sub)


def low_resolution(images: torch.Tensor, index: Sequence[int], scales: Sequence[float]) -> None:
    """Nearest-exact down to round(size * scale) per axis, trilinear back up. One channel at a time: every
    chosen channel has a downsampled shape of its own, so they cannot share one interpolate call (about an
    eighth of the channels fire)."""
    flat = _view(images)
    shape = flat.shape[1:]
    for row, scale in zip(index, scales, strict=True):
        small = [round(size * scale) for size in shape]
        down = F.interpolate(flat[row][None, None], small, mode="nearest-exact")
        flat[row] = F.interpolate(down, shape, mode="trilinear")[0, 0]


def gamma(images: torch.Tensor, index: Sequence[int], gammas: Sequence[float], invert: bool) -> None:
    """batchgeneratorsv2's GammaTransform with retain_stats: optionally negate, rescale to [0, 1] by the
    channel's min and range, raise to gamma, scale back, restore the channel's mean and std (unbiased),
    negate back."""
    if not index:
        return
    flat = _view(images)
    rows = torch.tensor(index, device=images.device)
    sub = flat[rows]
    if invert:
        sub = -sub
    dims = tuple(range(1, sub.ndim))
    mean, std = sub.mean(dims, keepdim=True), sub.std(dims, keepdim=True)
    low, high = sub.amin(dims, keepdim=True), sub.amax(dims, keepdim=True)
    span = high - low
    sub = ((sub - low) / span.clamp_min(_EPS)).pow(_column(gammas, sub)) * span + low
    here_mean, here_std = sub.mean(dims, keepdim=True), sub.std(dims, keepdim=True)
    sub = (sub - here_mean) * (std / here_std.clamp_min(_EPS)) + mean
    if invert:
        sub = -sub
    flat.index_copy_(0, rows, sub)
