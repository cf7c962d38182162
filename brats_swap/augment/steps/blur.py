"""Gaussian blur (batchgeneratorsv2's GaussianBlurTransform, synchronize_channels=False): with p, then on each
channel with p_per_channel, a sigma per axis (or one for all axes), separable with reflect padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from brats_swap.augment.ranges import UniformRange, draw_scalar
from brats_swap.augment.steps import channel_view, chosen_channels, temporaries_bytes

_NO_BLUR = (0.0, 0.0, 0.0)


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
    flat = channel_view(images)
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


@dataclass(frozen=True)
class Blur:
    """Value: per channel, the sigma (voxels) on each axis; (0, 0, 0) = not blurred."""

    p: float
    p_per_channel: float
    sigma: UniformRange
    synchronize_axes: bool
    name: ClassVar[str] = "blur"

    def neutral(self, channels: int) -> tuple[tuple[float, float, float], ...]:
        return (_NO_BLUR,) * channels

    def draw(self, rng: np.random.Generator, channels: int) -> tuple[tuple[float, float, float], ...]:
        """Per channel, per axis sigmas; (0, 0, 0) where not blurred."""
        if not rng.random() < self.p:
            return self.neutral(channels)
        chosen = rng.random(channels) < self.p_per_channel
        sigmas = []
        for use in chosen:
            if not use:
                sigmas.append(_NO_BLUR)
            elif self.synchronize_axes:
                sigmas.append((draw_scalar(rng, self.sigma),) * 3)
            else:
                sigmas.append(tuple(draw_scalar(rng, self.sigma) for _ in range(3)))
        return tuple(sigmas)

    def apply(self, images, labels, values, seeds) -> None:
        blur(images, *chosen_channels(values, _NO_BLUR))

    def buffer_bytes(self, batch: int, channels: int, patch_voxels: int, element_bytes: int) -> int:
        # the gathered channels, their padded copy and the convolution's output (and its kernel)
        return temporaries_bytes(batch, channels, patch_voxels, element_bytes, image_copies=4)
