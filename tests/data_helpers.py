"""Tiny BraTS-named NIfTI fixtures for the data tests (written with nibabel, a few KB each)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.data.editions import CANONICAL_MODALITIES, get_edition

SHAPE = (20, 18, 14)
AFFINE = np.array([[-1.0, 0, 0, 0], [0, -1.0, 0, 17.0], [0, 0, 1.0, 0], [0, 0, 0, 1]])

# One example id per naming scheme, with the edition discovery must find.
SCHEMES = {
    "2017": "Brats17_TCIA_105_1",
    "2020": "BraTS20_Training_001",
    "2021": "BraTS2021_00000",
    "2023": "BraTS-GLI-00000-000",
}


def brain_volumes(shape=SHAPE, seed: int = 0, edition: str = "2021") -> tuple[np.ndarray, np.ndarray]:
    """(4, X, Y, Z) float32 images (an ellipsoidal 'brain', distinct per channel) and a nested tumour seg."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij"))
    radius = np.sqrt((grid**2).sum(0))
    brain = radius < 0.8
    images = np.zeros((4, *shape), dtype=np.float32)
    for channel in range(4):
        images[channel][brain] = 100 * (channel + 1) + rng.normal(0, 5, int(brain.sum()))
    spec = get_edition(edition)
    necrotic = next(v for v in spec.region_labels["TC"] if v != spec.enhancing)
    tumour = np.sqrt(((grid - np.array([0.25, 0.1, 0.0])[:, None, None, None]) ** 2).sum(0))
    seg = np.zeros(shape, dtype=np.uint8)
    seg[(tumour < 0.45) & brain] = spec.edema
    seg[(tumour < 0.3) & brain] = spec.enhancing
    seg[(tumour < 0.15) & brain] = necrotic
    return images, seg


def write_volume(path: Path, data: np.ndarray, affine=AFFINE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


def write_case(folder: Path, case_id: str, edition: str, ext: str = ".nii.gz", seg: bool = True,
               shape=SHAPE, seed: int = 0, per_case_folder: bool = True,
               skip: tuple[str, ...] = ()) -> dict[str, Path]:
    """Write one case in the edition's naming scheme; returns role -> path ("seg" for the segmentation)."""
    spec = get_edition(edition)
    sep = "-" if edition == "2023" else "_"
    target = folder / case_id if per_case_folder else folder
    images, labels = brain_volumes(shape, seed, edition)
    paths = {}
    for channel, modality in enumerate(CANONICAL_MODALITIES):
        if modality in skip:
            continue
        paths[modality] = write_volume(target / f"{case_id}{sep}{spec.modality_suffixes[modality]}{ext}",
                                       images[channel])
    if seg and "seg" not in skip:
        paths["seg"] = write_volume(target / f"{case_id}{sep}{spec.seg_suffix}{ext}", labels)
    return paths
