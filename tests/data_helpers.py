"""Tiny BraTS-named NIfTI fixtures for the data tests (written with nibabel, a few KB each)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.data.challenges import CANONICAL_MODALITIES, get_challenge

SHAPE = (20, 18, 14)
AFFINE = np.array([[-1.0, 0, 0, 0], [0, -1.0, 0, 17.0], [0, 0, 1.0, 0], [0, 0, 0, 1]])

# One example id per naming scheme, with the table key discovery must find: the legacy editions and every
# 2023+ challenge (ids as the releases spell them).
SCHEMES = {
    "2017": "Brats17_TCIA_105_1",
    "2020": "BraTS20_Training_001",
    "2021": "BraTS2021_00000",
    "gli": "BraTS-GLI-00000-000",
    "gli-post": "BraTS-GLI-02711-100",
    "met": "BraTS-MET-00132-000",
    "men": "BraTS-MEN-00004-000",
    "men-rt": "BraTS-MEN-RT-0060-1",
    "ped": "BraTS-PED-00001-000",
    "ssa": "BraTS-SSA-00002-000",
    "goat": "BraTS-GoAT-01845",
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
    label = get_challenge(edition).tissues.get  # tissues a table does not label stay background
    tumour = np.sqrt(((grid - np.array([0.25, 0.1, 0.0])[:, None, None, None]) ** 2).sum(0))
    seg = np.zeros(shape, dtype=np.uint8)
    seg[(tumour < 0.45) & brain] = label("edema", 0)
    seg[(tumour < 0.3) & brain] = label("enhancing", 0)
    seg[(tumour < 0.15) & brain] = label("necrosis", 0)
    for tissue, centre in (("cyst", 0.1), ("cavity", -0.3)):  # PED's cyst, the resection cavity of GLI/MET
        if tissue in get_challenge(edition).tissues:
            spot = np.sqrt(((grid - np.array([centre, -0.1, 0.0])[:, None, None, None]) ** 2).sum(0))
            seg[(spot < 0.12) & brain] = label(tissue)
    return images, seg


def write_volume(path: Path, data: np.ndarray, affine=AFFINE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))
    return path


def write_case(folder: Path, case_id: str, edition: str, ext: str = ".nii.gz", seg: bool = True,
               shape=SHAPE, seed: int = 0, per_case_folder: bool = True,
               skip: tuple[str, ...] = ()) -> dict[str, Path]:
    """Write one case in the naming scheme of `edition` (any table key: modalities it ships only);
    returns role -> path ("seg" for the segmentation)."""
    spec = get_challenge(edition)
    sep = spec.separator
    target = folder / case_id if per_case_folder else folder
    images, labels = brain_volumes(shape, seed, edition)
    paths = {}
    for channel, modality in enumerate(CANONICAL_MODALITIES):
        if modality in skip or modality not in spec.modality_suffixes:
            continue
        paths[modality] = write_volume(target / f"{case_id}{sep}{spec.modality_suffixes[modality]}{ext}",
                                       images[channel])
    if seg and "seg" not in skip:
        paths["seg"] = write_volume(target / f"{case_id}{sep}{spec.seg_suffix}{ext}", labels)
    return paths


def link_case(paths: dict[str, Path], folder: Path, case_id: str) -> dict[str, Path]:
    """Another case with the same voxels as the case written at `paths` (write_case's answer): its files
    hard-linked into `folder / case_id` under `case_id`'s names. A test that needs many cases for their number,
    not their content, writes a few and links the rest (writing a 96x96x64 case costs half a second of CPU)."""
    source_id = next(iter(paths.values())).parent.name
    linked = {}
    for role, path in paths.items():
        target = folder / case_id / path.name.replace(source_id, case_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.hardlink_to(path)
        linked[role] = target
    return linked

