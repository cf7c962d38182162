"""The intensity transforms, batched over (sample, channel) pairs.

Every function takes the batch (B, C, X, Y, Z) and per-(sample, channel) parameters as a (B, C) tensor
whose neutral value means "leave this channel alone"; only the chosen channels are gathered, transformed
together and written back in place. The arithmetic is batchgeneratorsv2's for each transform (GaussianNoise,
GaussianBlur, MultiplicativeBrightness, Contrast with preserve_range, SimulateLowResolution, Gamma with
retain_stats, BrightnessAdditive), so one channel's result equals that library's within float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_EPS = 1e-7  # batchgeneratorsv2's gamma epsilon


def _chosen(images: torch.Tensor, values: torch.Tensor, neutral: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (sample * C + channel) indices of the channels whose value is not neutral, and their values."""
    flat = values.reshape(-1)
    index = torch.nonzero(flat != neutral).flatten()
    return index, flat[index]


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


def _kernels(sigmas: torch.Tensor) -> torch.Tensor:
    """(n,) sigmas -> (n, K) normalised Gaussian taps, each zero outside its own kernel size, K the largest."""
    sizes = [_kernel_size(float(s)) for s in sigmas.tolist()]
    width = max(sizes)
    x = torch.arange(width, device=sigmas.device, dtype=torch.float32) - (width - 1) / 2
    half = torch.tensor([(s - 1) / 2 for s in sizes], device=sigmas.device, dtype=torch.float32)
    pdf = torch.exp(-0.5 * (x[None] / sigmas[:, None].float()) ** 2) * (x[None].abs() <= half[:, None])
    return pdf / pdf.sum(1, keepdim=True)


def blur(images: torch.Tensor, sigmas: torch.Tensor) -> None:
    """Separable Gaussian blur, reflect padding; sigmas (B, C, 3), 0 = channel not blurred. Kernels of
    different sizes share one grouped convolution per axis: a kernel zero-padded to the largest size reads
    the same reflected voxels with the same weights."""
    chosen = torch.nonzero(sigmas.reshape(-1, 3)[:, 0] != 0).flatten()
    if chosen.numel() == 0:
        return
    flat = _view(images)
    sub = flat[chosen][None]  # (1, n, X, Y, Z)
    axis_sigmas = sigmas.reshape(-1, 3)[chosen]
    for axis in range(3):
        kernels = _kernels(axis_sigmas[:, axis]).to(images.dtype)
        width = kernels.shape[1]
        shape = [1, 1, 1]
        shape[axis] = width
        pad = [0, 0, 0, 0, 0, 0]
        pad[4 - 2 * axis] = pad[5 - 2 * axis] = width // 2
        padded = F.pad(sub, pad, mode="reflect")
        sub = F.conv3d(padded, kernels.view(-1, 1, *shape), groups=kernels.shape[0])
    flat.index_copy_(0, chosen, sub[0])


def multiply(images: torch.Tensor, factors: torch.Tensor) -> None:
    """Multiplicative brightness: each channel times its factor (1 = none)."""
    images.mul_(factors.to(images.dtype)[..., None, None, None])


def add(images: torch.Tensor, shifts: torch.Tensor) -> None:
    """Additive brightness: each channel plus its shift (0 = none)."""
    images.add_(shifts.to(images.dtype)[..., None, None, None])


def contrast(images: torch.Tensor, factors: torch.Tensor) -> None:
    """(x - mean) * factor + mean, clamped to the channel's original min and max (preserve_range)."""
    chosen, values = _chosen(images, factors, 1.0)
    if chosen.numel() == 0:
        return
    flat = _view(images)
    sub = flat[chosen]
    dims = tuple(range(1, sub.ndim))
    mean = sub.mean(dims, keepdim=True)
    low, high = sub.amin(dims, keepdim=True), sub.amax(dims, keepdim=True)
    scale = values.to(sub.dtype).view(-1, 1, 1, 1)
    sub = torch.minimum(torch.maximum((sub - mean) * scale + mean, low), high)
    flat.index_copy_(0, chosen, sub)


def low_resolution(images: torch.Tensor, scales: torch.Tensor) -> None:
    """Nearest-exact down to round(size * scale) per axis, trilinear back up (1 = none). One channel at a
    time: every chosen channel has a downsampled shape of its own, so they cannot share one interpolate call
    (about an eighth of the channels fire)."""
    chosen, values = _chosen(images, scales, 1.0)
    flat = _view(images)
    shape = flat.shape[1:]
    for index, scale in zip(chosen.tolist(), values.tolist(), strict=True):
        small = [round(size * scale) for size in shape]
        down = F.interpolate(flat[index][None, None], small, mode="nearest-exact")
        flat[index] = F.interpolate(down, shape, mode="trilinear")[0, 0]


def gamma(images: torch.Tensor, gammas: torch.Tensor, invert: bool) -> None:
    """batchgeneratorsv2's GammaTransform with retain_stats: optionally negate, rescale to [0, 1] by the
    channel's min and range, raise to gamma, scale back, restore the channel's mean and std (unbiased),
    negate back. Gamma 1 = none."""
    chosen, values = _chosen(images, gammas, 1.0)
    if chosen.numel() == 0:
        return
    flat = _view(images)
    sub = flat[chosen]
    if invert:
        sub = -sub
    dims = tuple(range(1, sub.ndim))
    mean, std = sub.mean(dims, keepdim=True), sub.std(dims, keepdim=True)
    low, high = sub.amin(dims, keepdim=True), sub.amax(dims, keepdim=True)
    span = high - low
    sub = ((sub - low) / span.clamp_min(_EPS)).pow(values.to(sub.dtype).view(-1, 1, 1, 1)) * span + low
    here_mean, here_std = sub.mean(dims, keepdim=True), sub.std(dims, keepdim=True)
    sub = (sub - here_mean) * (std / here_std.clamp_min(_EPS)) + mean
    if invert:
        sub = -sub
    flat.index_copy_(0, chosen, sub)
