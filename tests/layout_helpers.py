"""BraTS-named phantom folders rewritten in the layouts nnU-Net and the Decathlon use (for the layout tests).

- `to_nnunet_brats21`: what nnU-Net v2's `Dataset137_BraTS21.py` does to a BraTS 2021 folder: channels
  `_0000` T1, `_0001` T1ce, `_0002` T2, `_0003` Flair; labels renumbered 4 -> 3, 2 -> 1, 1 -> 2; a
  dataset.json as its `generate_dataset_json` writes it (regions only).
- `to_nnunet_kept`: a 2023+ conversion that keeps the challenge's values (as `Dataset226_BraTS2024-BraTS-GLI.py`
  declares them: background, NETC, SNFH, ET, RC).
- `to_msd_task01`: the Decathlon's Task01_BrainTumour: one 4D image per case (FLAIR, T1w, T1gd, T2w), labels
  1 edema, 2 non-enhancing tumour, 3 enhancing tumour, ids BRATS_001 ...
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.data.discovery import discover_cases

# Dataset137_BraTS21.py: seg_new[img == 4] = 3; seg_new[img == 2] = 1; seg_new[img == 1] = 2.
BRATS21_TO_NNUNET = {4: 3, 2: 1, 1: 2}
# Task01_BrainTumour: 1 edema (BraTS 2), 2 non-enhancing tumour (BraTS 1), 3 enhancing tumour (BraTS 4).
BRATS_TO_MSD = {2: 1, 1: 2, 4: 3}
NNUNET_CHANNELS = ("t1", "t1ce", "t2", "flair")
MSD_CHANNELS = ("flair", "t1", "t1ce", "t2")


def _renumber(seg: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    out = np.zeros_like(seg)
    for old, new in mapping.items():
        out[seg == old] = new
    return out


def _copy(source: Path, target: Path, data=None) -> None:
    image = nib.load(str(source))
    target.parent.mkdir(parents=True, exist_ok=True)
    values = np.asarray(image.dataobj) if data is None else data
    nib.save(nib.Nifti1Image(values, image.affine, image.header), str(target))


def to_nnunet_brats21(brats: Path, out: Path) -> Path:
    cases = discover_cases(brats)
    for case in cases:
        for index, modality in enumerate(NNUNET_CHANNELS):
            _copy(case.images[modality], out / "imagesTr" / f"{case.case_id}_{index:04d}.nii.gz")
        seg = np.asarray(nib.load(str(case.seg)).dataobj)
        _copy(case.seg, out / "labelsTr" / f"{case.case_id}.nii.gz", _renumber(seg, BRATS21_TO_NNUNET))
    write_json(out / "dataset.json", {
        "channel_names": {"0": "T1", "1": "T1ce", "2": "T2", "3": "Flair"},
        "labels": {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]},
        "numTraining": len(cases), "file_ending": ".nii.gz", "regions_class_order": [1, 2, 3],
        "license": "phantoms", "reference": "phantoms", "dataset_release": "1.0"})
    return out


def nnunet_phantoms(root: Path, shapes, seed: int, id_offset: int) -> Path:
    """One phantom per shape (seeds and case ids counted from `seed` and `id_offset`), written in nnU-Net's
    BraTS 2021 layout under `root` (`to_nnunet_brats21`); returns that dataset folder."""
    from brats_swap.data.phantom import synthesize_dataset

    brats = root / "brats"
    for index, shape in enumerate(shapes):
        synthesize_dataset(brats, 1, seed=seed + index, edition="2021", shape=shape, id_offset=id_offset + index)
    return to_nnunet_brats21(brats, root / "Dataset137_BraTS2021")


def to_nnunet_kept(brats: Path, out: Path) -> Path:
    cases = discover_cases(brats)
    for case in cases:
        for index, modality in enumerate(NNUNET_CHANNELS):
            _copy(case.images[modality], out / "imagesTr" / f"{case.case_id}_{index:04d}.nii.gz")
        _copy(case.seg, out / "labelsTr" / f"{case.case_id}.nii.gz")
    write_json(out / "dataset.json", {
        "channel_names": {"0": "T1", "1": "T1C", "2": "T2W", "3": "T2F"},
        "labels": {"background": 0, "NETC": 1, "SNFH": 2, "ET": 3, "RC": 4},
        "numTraining": len(cases), "file_ending": ".nii.gz"})
    return out


def to_msd_task01(brats: Path, out: Path) -> dict[str, str]:
    """Writes the Decathlon folder; returns MSD case id -> original case id."""
    cases = discover_cases(brats)
    names = {}
    for number, case in enumerate(cases, start=1):
        case_id = f"BRATS_{number:03d}"
        names[case_id] = case.case_id
        first = nib.load(str(case.images["flair"]))
        stacked = np.stack([np.asarray(nib.load(str(case.images[m])).dataobj) for m in MSD_CHANNELS], axis=-1)
        (out / "imagesTr").mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image(stacked, first.affine), str(out / "imagesTr" / f"{case_id}.nii.gz"))
        seg = np.asarray(nib.load(str(case.seg)).dataobj)
        _copy(case.seg, out / "labelsTr" / f"{case_id}.nii.gz", _renumber(seg, BRATS_TO_MSD))
    write_json(out / "dataset.json", {
        "name": "BRATS", "tensorImageSize": "4D",
        "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
        "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
        "numTraining": len(cases), "numTest": 0,
        "training": [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in names],
        "test": []})
    return names


def write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2))
