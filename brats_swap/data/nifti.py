"""NIfTI input/output with nibabel, and the validation of a case.

Channel order. `load_case` stacks the modalities in the order asked for, by default
`CANONICAL_MODALITIES = (t1, t1ce, t2, flair)`: channel 0 is T1, 1 is T1 with contrast (t1ce / t1Gd / t1c),
2 is T2 (t2 / t2w), 3 is FLAIR (flair / t2f), in every edition. Voxel order is the file's own (X, Y, Z);
nothing is reoriented, so a prediction written with the case's affine lands back on the same voxels.

Every problem is a `DataError` whose one-line message names the case, the file and what is wrong.
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.atomic import atomic_write_bytes
from brats_swap.data.discovery import SEG, Case
from brats_swap.data.editions import CANONICAL_MODALITIES, get_edition
from brats_swap.errors import DataError

# Affines of one case's files may differ by float noise from resampling tools; more than this is a
# different grid. 1e-3 mm is far below a voxel and far above float32 round-off of a 240 mm offset.
AFFINE_TOLERANCE = 1e-3
# A BraTS volume is ~9 M voxels (35 MB as float32); a header declaring more than this is damaged.
MAX_VOLUME_BYTES = 4 * 2**30


@dataclass
class LoadedCase:
    case_id: str
    edition: str
    image: np.ndarray  # float32 (C, X, Y, Z), channels in the order of `modalities`
    seg: np.ndarray | None  # uint8 (X, Y, Z) with the edition's raw label values
    affine: np.ndarray  # 4x4 voxel -> world (mm) of the first modality
    header: nib.Nifti1Header  # header of the first modality (dtype, qform/sform codes, units)
    modalities: tuple[str, ...] = CANONICAL_MODALITIES
    warnings: list[str] = field(default_factory=list)  # non-fatal notes (e.g. a seg affine that differs)

    @property
    def spacing(self) -> tuple[float, float, float]:
        return tuple(float(z) for z in self.header.get_zooms()[:3])  # type: ignore[return-value]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.image.shape[1:])  # type: ignore[return-value]


def load_case(case: Case, modalities: tuple[str, ...] | list[str] = CANONICAL_MODALITIES) -> LoadedCase:
    """Load and validate one case; raise DataError on the first problem found."""
    modalities = tuple(modalities)
    missing = [m for m in modalities if m not in case.images]
    if missing:
        raise DataError(
            f"case {case.case_id}: missing modality {missing[0]} (expected file {case.expected_name(missing[0])})"
        )
    spec = get_edition(case.edition)

    channels = []
    reference_path = case.images[modalities[0]]
    affine = header = None
    for modality in modalities:
        path = case.images[modality]
        volume, volume_affine, volume_header = read_volume(case.case_id, path)
        if affine is None:
            affine, header, shape = volume_affine, volume_header, volume.shape
        else:
            _check_same_grid(case.case_id, path, volume.shape, volume_affine, reference_path, shape, affine)
        _check_intensities(case.case_id, path, volume)
        channels.append(volume)
    image = np.stack(channels)

    seg = None
    warnings: list[str] = []
    if case.seg is not None:
        raw, seg_affine, _ = read_volume(case.case_id, case.seg, as_float=False)
        if raw.shape != shape:
            raise DataError(
                f"case {case.case_id}: file {case.seg.name}: segmentation shape {_fmt(raw.shape)} differs from "
                f"{reference_path.name} {_fmt(shape)}"
            )
        seg = _labels_as_uint8(case.case_id, case.seg, raw, spec.label_values, spec.name)
        difference = float(np.abs(seg_affine - affine).max())
        if difference > AFFINE_TOLERANCE:
            # Some releases write the truth with another origin (Ellis copied the image's origin onto it);
            # the voxel grid is what matters, so we keep the image affine and say so.
            warnings.append(f"{case.seg.name}: affine differs from {reference_path.name} by {difference:.3g} "
                            "(image affine used)")
    return LoadedCase(case.case_id, case.edition, image, seg, affine, header, modalities, warnings)


def read_volume(case_id: str, path: Path, as_float: bool = True) -> tuple[np.ndarray, np.ndarray, nib.Nifti1Header]:
    """One 3D volume (float32, or the stored dtype), its affine and header; DataError if unusable."""
    where = f"case {case_id}: file {path.name}"
    if not os.access(path, os.R_OK):
        reason = "permission denied" if path.exists() else "file not found"
        raise DataError(f"{where}: {reason}")
    try:
        img = nib.load(str(path), mmap=False)
    except nib.filebasedimages.ImageFileError as exc:
        raise DataError(f"{where}: not a NIfTI file ({_short(exc)})") from exc
    except (OSError, EOFError, zlib.error, ValueError, OverflowError, nib.spatialimages.HeaderDataError) as exc:
        raise DataError(f"{where}: unreadable ({_short(exc)})") from exc
    if not isinstance(img, (nib.Nifti1Image, nib.Nifti2Image)):
        raise DataError(f"{where}: not a NIfTI file ({type(img).__name__})")
    shape = img.shape
    if len(shape) > 3 and all(s == 1 for s in shape[3:]):
        shape = shape[:3]
    if len(shape) != 3:
        raise DataError(f"{where}: {len(img.shape)}D image of shape {_fmt(img.shape)}, expected one 3D volume")
    _check_declared_size(where, path, img)
    if np.issubdtype(img.get_data_dtype(), np.complexfloating):
        raise DataError(f"{where}: complex-valued voxels ({img.get_data_dtype()}), expected a real-valued volume")
    try:
        data = img.get_fdata(dtype=np.float32) if as_float else np.asanyarray(img.dataobj)
    except (OSError, EOFError, zlib.error, ValueError, OverflowError, MemoryError, gzip.BadGzipFile,
            nib.spatialimages.HeaderDataError) as exc:
        raise DataError(f"{where}: unreadable or truncated ({_short(exc)})") from exc
    return data.reshape(shape), np.asarray(img.affine, dtype=np.float64), img.header


def _check_declared_size(where: str, path: Path, img) -> None:
    # nibabel allocates the size the header declares before reading: a damaged header could make it
    # claim gigabytes (or terabytes) for a file of a few hundred bytes.
    declared = int(np.prod([int(s) for s in img.shape], dtype=object)) * img.get_data_dtype().itemsize
    if declared > MAX_VOLUME_BYTES:
        raise DataError(f"{where}: header declares a {_fmt(img.shape)} image ({declared / 2**30:.3g} GiB), "
                        "far larger than any MRI volume; the header is damaged")
    if not path.name.endswith(".gz"):
        available = path.stat().st_size - int(img.header.get_data_offset())
        if declared > available:
            raise DataError(f"{where}: truncated: the header declares {declared} bytes of voxels, "
                            f"the file holds {max(available, 0)}")


def save_label_nifti(label: np.ndarray, affine: np.ndarray, path: str | os.PathLike,
                     header: nib.Nifti1Header | None = None) -> Path:
    """Write a label map as uint8 .nii.gz with the given affine (and the source header), atomically."""
    target = Path(path)
    if not target.name.endswith(".nii.gz"):
        target = target.with_name(target.name.removesuffix(".nii") + ".nii.gz")
    save_nifti(np.asarray(label).astype(np.uint8, copy=False), affine, target, header=header, dtype=np.uint8)
    return target


def save_nifti(data: np.ndarray, affine: np.ndarray, path: str | os.PathLike,
               header: nib.Nifti1Header | None = None, dtype=None, compresslevel: int = 6) -> None:
    """Atomic NIfTI write. `.nii.gz` files get a fixed gzip mtime, so equal arrays give equal bytes."""
    image_class = nib.Nifti2Image if isinstance(header, nib.Nifti2Header) else nib.Nifti1Image
    affine = np.asarray(affine, dtype=np.float64)  # meta.json stores it as nested lists
    img = image_class(data, affine, header=header.copy() if header is not None else None)
    img.set_data_dtype(dtype or data.dtype)
    img.header.set_slope_inter(None, None)  # raw values as stored: no scaling inherited from the source
    if header is None:
        img.set_qform(affine, code=1)  # "scanner" codes, as the BraTS files have
        img.set_sform(affine, code=1)
    payload = img.to_bytes()
    if str(path).endswith(".gz"):
        payload = gzip.compress(payload, compresslevel=compresslevel, mtime=0)
    atomic_write_bytes(path, payload)


def _check_same_grid(case_id: str, path: Path, shape, affine, reference: Path, reference_shape, reference_affine):
    if shape != reference_shape:
        raise DataError(f"case {case_id}: file {path.name}: shape {_fmt(shape)} differs from "
                        f"{reference.name} {_fmt(reference_shape)}")
    difference = float(np.abs(affine - reference_affine).max())
    if difference > AFFINE_TOLERANCE:
        raise DataError(f"case {case_id}: file {path.name}: affine differs from {reference.name} "
                        f"(max difference {difference:.3g})")


def _check_intensities(case_id: str, path: Path, volume: np.ndarray) -> None:
    finite = np.isfinite(volume)
    if not finite.all():
        raise DataError(f"case {case_id}: file {path.name}: {int(volume.size - finite.sum())} non-finite voxels")
    if not volume.any():
        raise DataError(f"case {case_id}: file {path.name}: every voxel is zero")


def _labels_as_uint8(case_id: str, path: Path, raw: np.ndarray, allowed: tuple[int, ...], edition: str) -> np.ndarray:
    where = f"case {case_id}: file {path.name}"
    if not (np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating) or raw.dtype == bool):
        raise DataError(f"{where}: segmentation of type {raw.dtype}, expected integer labels")
    if np.issubdtype(raw.dtype, np.floating):
        if not np.isfinite(raw).all():
            raise DataError(f"{where}: non-finite values in the segmentation")
        if not np.array_equal(raw, np.round(raw)):
            raise DataError(f"{where}: non-integer values in the segmentation")
    values = np.unique(raw)
    unexpected = [v for v in values.tolist() if int(v) != 0 and int(v) not in allowed]
    if unexpected:
        shown = ", ".join(str(int(v)) for v in unexpected[:5])
        raise DataError(f"{where}: labels {{{shown}}} not in the {edition} edition's table "
                        f"{{0, {', '.join(map(str, allowed))}}}")
    return raw.astype(np.uint8)


def _fmt(shape) -> str:
    return "x".join(str(int(s)) for s in shape)


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


__all__ = ["AFFINE_TOLERANCE", "SEG", "LoadedCase", "load_case", "read_volume", "save_label_nifti", "save_nifti"]
