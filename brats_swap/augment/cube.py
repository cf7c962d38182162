"""The recipes that only move voxels the network sees unchanged: `cube48` (one of the 48 rotations and
reflections of the cube per sample, the paper's) and `none`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# The 48 symmetries of a cube (the full octahedral group with reflections): 6 axis permutations x 8 flips.
# Ellis's `generate_permutation_keys` enumerates the same group as rotate/transpose/flip combinations.
CUBE_SYMMETRIES: tuple[tuple[tuple[int, int, int], tuple[bool, bool, bool]], ...] = tuple(
    (perm, flips)  # type: ignore[misc]
    for perm in itertools.permutations(range(3))
    for flips in itertools.product((False, True), repeat=3)
)


@dataclass(frozen=True)
class CubeSymmetry:
    """One sample's cube48 draw: permute the spatial axes by `perm`, then flip the axes marked in `flips`."""

    perm: tuple[int, int, int]
    flips: tuple[bool, bool, bool]


def allowed_symmetries(shape: Sequence[int]) -> list[tuple[tuple[int, int, int], tuple[bool, bool, bool]]]:
    """Symmetries that keep the array shape: an axis permutation may only swap axes of equal size."""
    return [(perm, flips) for perm, flips in CUBE_SYMMETRIES if all(shape[p] == shape[i] for i, p in enumerate(perm))]


def apply_symmetry(tensor: torch.Tensor, perm: Sequence[int], flips: Sequence[bool]) -> torch.Tensor:
    """Permute then flip the last three (spatial) axes of `tensor`; leading axes (channels) are kept."""
    lead = tensor.dim() - 3
    moved = tensor.permute(*range(lead), *(lead + p for p in perm))
    flip_axes = [lead + i for i, f in enumerate(flips) if f]
    return (moved.flip(flip_axes) if flip_axes else moved).contiguous()


def copy_buffer_bytes(batch: int, channels: int, crop: Sequence[int]) -> int:
    """A float32 copy of the batch and its int64 labels, while they are permuted or transformed sample by
    sample (cube48, mild, none)."""
    return batch * math.prod(int(v) for v in crop) * (channels * 4 + 8)


class PlainRecipe:
    """A recipe that reads the sample itself and transforms it sample by sample, in one copy of the batch."""

    def crop_size(self, sample_size: Sequence[int], patch_mode: bool) -> tuple[int, int, int]:
        return tuple(int(v) for v in sample_size)  # type: ignore[return-value]

    def buffer_bytes(self, batch: int, channels: int, sample_size: Sequence[int], num_labels: int,
                     crop: Sequence[int]) -> int:
        return copy_buffer_bytes(batch, channels, crop)


class Cube48(PlainRecipe):
    def draw(self, rng: np.random.Generator, sample_size: tuple[int, int, int], channels: int) -> CubeSymmetry:
        options = allowed_symmetries(sample_size)
        perm, flips = options[int(rng.integers(len(options)))]
        return CubeSymmetry(perm, flips)

    def apply(self, images, labels, params, sample_size, label_values):
        pairs = [(apply_symmetry(image, p.perm, p.flips), apply_symmetry(label, p.perm, p.flips))
                 for image, label, p in zip(images, labels, params, strict=True)]
        return torch.stack([image for image, _ in pairs]), torch.stack([label for _, label in pairs])


class NoAugment(PlainRecipe):
    def draw(self, rng, sample_size, channels) -> None:
        return None

    def apply(self, images, labels, params, sample_size, label_values):
        return images, labels


CUBE48 = Cube48()
NONE = NoAugment()
