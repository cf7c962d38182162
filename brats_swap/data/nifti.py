"""NIfTI input/output with nibabel, and the validation of a case.

Channel order. `load_case` stacks the modalities in the order asked for, by default
`CANONICAL_MODALITIES = (t1, t1ce, t2, flair)`: channel 0 is T1, 1 is T1 with contrast (t1ce / t1Gd / t1c),
2 is T2 (t2 / t2w), 3 is FLAIR (flair / t2f), in every edition. Voxel order is the file's own (X, Y, Z);
nothing is reoriented, so a prediction written with the case's affine lands back on the same voxels.

Integrity. A file is read once into memory; a `.nii.gz` is inflated with zlib in gzip mode, which checks
the trailer's CRC-32 and length (ISIZE) of every member while it decompresses (one pass over the bytes),
and nibabel parses the checked bytes. nibabel on its own reads the voxels without looking at the trailer,
so a flipped bit in the compressed stream would decode silently to different voxels; here it is a
`DataError` ("damaged gzip data") and the file is never used.

Size. Files come from someone else, so only a regular file is read (after following links: a FIFO would
block forever, a device such as /dev/zero never ends, and both report no size), through one open file whose
kind is checked on the open descriptor itself, and never more bytes than the file held when it was opened.
The header is read first (the first bytes inflated, or read, alone) and what it declares (voxel offset +
voxels) bounds everything after it: a header declaring more than MAX_VOLUME_BYTES is refused before any
voxel is inflated, and inflating stops at the declared size (plus TRAILING_BYTES_ALLOWED): a small `.nii.gz`
that would unpack to gigabytes is refused having allocated about its header's size. What decoding costs is
priced from the same header before anything else is allocated (`decoded_bytes`: the compressed bytes, the
inflated bytes, nibabel's copy of them, its float64 scaling intermediate and the float32 array) and refused
above MAX_DECODED_BYTES. A `.nii.gz` much larger than the bytes its header declares is refused before it is
read whole (deflate never expands data by more than ~0.1%).

Labels. A segmentation may hold only the values of its case's table (`brats_swap.data.challenges`);
anything else is refused with the values, the table checked and the config keys that choose another. A
case of a dataset.json layout is first renumbered from its dataset's values (`Case.label_map`). A 4D image
is read only where the dataset.json says a case is one (the Decathlon's), and split into its channels.

Every problem is a `DataError` whose one-line message names the case, the file and what is wrong.
"""

from __future__ import annotations

import gzip
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np

from brats_swap.atomic import atomic_write_bytes
from brats_swap.data.challenges import CANONICAL_MODALITIES, MODERN_CHALLENGES, ChallengeSpec, get_challenge
from brats_swap.data.discovery import SEG, Case
from brats_swap.errors import DataError
from brats_swap.foreign_files import open_regular

# Affines of one case's files may differ by float noise from resampling tools; more than this is a
# different grid. 1e-3 mm is far below a voxel and far above float32 round-off of a 240 mm offset.
AFFINE_TOLERANCE = 1e-3
# A BraTS volume is ~9 M voxels (35 MB as float32); a header declaring more than this is damaged.
MAX_VOLUME_BYTES = 4 * 2**30
# What reading one file may cost in memory, all copies counted (`decoded_bytes`): 2 GiB holds a 0.5 mm 7 T
# volume (400x400x300 float32, ~1.2 GiB priced) with room; a 512^3 uint8 header (2.25 GiB priced) is refused.
MAX_DECODED_BYTES = 2 * 2**30
# Per voxel, besides twice the stored bytes (the inflated payload and nibabel's copy): the float32 array and
# the float64 intermediate nibabel makes while scaling (measured: at most 2 x itemsize + 15 B, uint8 scaled).
_DECODING_BYTES_PER_VOXEL = 16
# Deflate's worst case is stored blocks (5 bytes per 65535); gzip headers, trailers and zero padding add a few
# bytes. A .nii.gz larger than this share of what its header declares (plus the trailing allowance) is not a
# compressed NIfTI of that header.
_DEFLATE_EXPANSION = 1.001
# Bytes a file may hold after the voxels its header declares (ignored, but inflated to check the CRC): writers
# end the file at the last voxel, so anything near this size is another file's data, not padding.
TRAILING_BYTES_ALLOWED = 2**20
NIFTI_HEADER_BYTES = nib.Nifti2Header.template_dtype.itemsize  # 540: holds a NIfTI-2 (or a NIfTI-1) header
GZIP_MAGIC = b"\x1f\x8b"
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib's gzip mode: header, deflate stream, CRC-32 and ISIZE checked
# What nibabel raises on bytes that are not a usable image (damaged header fields, short data, ...).
_NIBABEL_ERRORS = (OSError, EOFError, zlib.error, ValueError, OverflowError, MemoryError, struct.error,
                   gzip.BadGzipFile, nib.spatialimages.HeaderDataError, nib.filebasedimages.ImageFileError)


@dataclass
class LoadedCase:
    case_id: str
    edition: str
    image: np.ndarray  # float32 (C, X, Y, Z), channels in the order of `modalities`
    seg: np.ndarray | None  # uint8 (X, Y, Z) with the raw label values of the case's table
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


def load_case(case: Case, modalities: tuple[str, ...] | list[str] = CANONICAL_MODALITIES, *,
              label: bool = True) -> LoadedCase:
    """Load and validate one case; raise DataError on the first problem found. `label=False` leaves the
    segmentation unread (prediction needs only the images: `seg` is then None)."""
    modalities = tuple(modalities)
    spec = get_challenge(case.edition)
    not_shipped = [m for m in modalities if m not in spec.modality_suffixes]
    if not_shipped:
        shipped = list(spec.modality_suffixes)
        raise DataError(f"case {case.case_id}: the {spec.key} challenge ships no {not_shipped[0]} image (only "
                        f"{', '.join(shipped)}): set data.modalities=[{','.join(shipped)}]")
    missing = [m for m in modalities if m not in case.images]
    if missing:
        raise DataError(
            f"case {case.case_id}: missing modality {missing[0]} (expected file {case.expected_name(missing[0])})"
        )

    channels = []
    reference_path = case.images[modalities[0]]
    affine = header = None
    four_d: dict[Path, tuple[np.ndarray, np.ndarray, nib.Nifti1Header]] = {}  # a 4D file is read once
    for modality in modalities:
        path = case.images[modality]
        if modality in case.channels:
            if path not in four_d:
                four_d[path] = read_volume(case.case_id, path, channels=len(set(case.channels.values())))
            stacked, volume_affine, volume_header = four_d[path]
            volume = stacked[..., case.channels[modality]]
        else:
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
    if label and case.seg is not None:
        raw, seg_affine, _ = read_volume(case.case_id, case.seg, as_float=False)
        if raw.shape != shape:
            raise DataError(
                f"case {case.case_id}: file {case.seg.name}: segmentation shape {_fmt(raw.shape)} differs from "
                f"{reference_path.name} {_fmt(shape)}"
            )
        where = f"case {case.case_id}: file {case.seg.name}"
        if case.label_map is not None:
            raw = to_table_values(where, raw, case.label_map, spec, case.description)
        seg = labels_as_uint8(where, raw, spec, case.case_id)
        difference = float(np.abs(seg_affine - affine).max())
        if difference > AFFINE_TOLERANCE:
            # Some releases write the truth with another origin (Ellis copied the image's origin onto it);
            # the voxel grid is what matters, so we keep the image affine and say so.
            warnings.append(f"{case.seg.name}: affine differs from {reference_path.name} by {difference:.3g} "
                            "(image affine used)")
    return LoadedCase(case.case_id, case.edition, image, seg, affine, header, modalities, warnings)


def read_volume(case_id: str, path: Path, as_float: bool = True,
                channels: int | None = None) -> tuple[np.ndarray, np.ndarray, nib.Nifti1Header]:
    """One 3D volume (float32, or the stored dtype), its affine and header; DataError if unusable.
    With `channels`, a 4D image of that many channels (X, Y, Z, C), as the Decathlon stores a case; a 4D
    image is refused everywhere else.

    The file is read once; a `.nii.gz` must pass `gunzip_checked` (CRC-32 and length) before any voxel is
    looked at."""
    where = f"case {case_id}: file {path.name}"
    if not os.access(path, os.R_OK):
        reason = "permission denied" if path.exists() else "file not found"
        raise DataError(f"{where}: {reason}")
    try:
        with open_regular(path, where, what="file") as file:
            size = os.fstat(file.fileno()).st_size
            if path.name.endswith(".gz"):
                payload = gunzip_checked(where, _read_compressed(where, file, size))
            else:
                payload = _read_uncompressed(where, file, size)
    except OSError as exc:
        raise DataError(f"{where}: unreadable ({_short(exc)})") from exc
    img = _image_from_bytes(where, payload)
    shape = img.shape
    if len(shape) > 3 and all(s == 1 for s in shape[3:]):
        shape = shape[:3]
    if channels is not None:
        if len(shape) != 4 or shape[3] != channels:
            raise DataError(f"{where}: image of shape {_fmt(img.shape)}, expected a 4D image of {channels} "
                            "channels (the dataset.json's channels)")
    elif len(shape) != 3:
        raise DataError(f"{where}: {len(img.shape)}D image of shape {_fmt(img.shape)}, expected one 3D volume")
    _check_declared_size(where, len(payload), img)
    _check_geometry(where, img)
    if np.issubdtype(img.get_data_dtype(), np.complexfloating):
        raise DataError(f"{where}: complex-valued voxels ({img.get_data_dtype()}), expected a real-valued volume")
    try:
        data = img.get_fdata(dtype=np.float32) if as_float else np.asanyarray(img.dataobj)
    except _NIBABEL_ERRORS as exc:
        raise DataError(f"{where}: unreadable or truncated ({_short(exc)})") from exc
    return data.reshape(shape), np.asarray(img.affine, dtype=np.float64), img.header


def gunzip_checked(where: str, stored: bytes) -> bytes:
    """The decompressed bytes of a `.nii.gz`, every gzip member's CRC-32 and length verified, inflated no
    further than its NIfTI header declares (see Size in the module docstring); DataError naming `where` for
    anything else: no gzip header, a truncated or damaged stream, a header declaring more than
    MAX_VOLUME_BYTES, more bytes than the header declares."""
    stream = _GzipStream(where, stored)
    head = stream.read(NIFTI_HEADER_BYTES)
    limit = declared_file_bytes(where, head, stored=len(stored)) + TRAILING_BYTES_ALLOWED
    payload = head + stream.read(limit + 1 - len(head))
    if len(payload) > limit:
        raise DataError(f"{where}: decompresses to more than the {limit - TRAILING_BYTES_ALLOWED} bytes its header "
                        "declares; the file is damaged and is not read")
    return payload


class _GzipStream:
    """A gzip file's bytes inflated on demand, member after member, so a reader stops where it wants; zlib's
    gzip mode checks each member's CRC-32 and length (ISIZE) as the member ends."""

    def __init__(self, where: str, stored: bytes):
        if not stored.startswith(GZIP_MAGIC):
            raise DataError(f"{where}: not a NIfTI file (no gzip header in a .gz file)")
        self.where = where
        self._inflater = zlib.decompressobj(_GZIP_WBITS)
        self._input = stored
        self._ended = False

    def read(self, size: int) -> bytes:
        """The next `size` bytes, fewer only at the end of the last member (which has then been checked)."""
        parts: list[bytes] = []
        while size > 0 and not self._ended:
            try:
                chunk = self._inflater.decompress(self._input, size)
            except zlib.error as exc:  # a damaged deflate stream, or a CRC-32 / length that does not match
                raise DataError(f"{self.where}: damaged gzip data ({exc}): the file is corrupt and is not read") from exc
            self._input = self._inflater.unconsumed_tail
            parts.append(chunk)
            size -= len(chunk)
            if self._inflater.eof:
                self._next_member()
            elif not chunk and not self._input:
                raise DataError(f"{self.where}: unreadable or truncated (the gzip stream ends before its CRC trailer)")
        return b"".join(parts)

    def _next_member(self) -> None:
        rest = self._inflater.unused_data
        if rest.startswith(GZIP_MAGIC):  # several members: what `cat a.gz b.gz` or some writers give
            self._inflater, self._input = zlib.decompressobj(_GZIP_WBITS), rest
        elif rest.strip(b"\0"):  # zero padding after the last member is what some tools write
            raise DataError(f"{self.where}: damaged gzip data ({len(rest)} bytes of garbage after the stream)")
        else:
            self._ended = True


def declared_file_bytes(where: str, head: bytes, stored: int = 0) -> int:
    """The bytes a single-file NIfTI holds by the header at the start of `head` (its voxel offset plus the
    voxels it declares); DataError when `head` starts with no NIfTI header, one declaring more than
    MAX_VOLUME_BYTES of voxels, or one whose decoding (`decoded_bytes`, with `stored` compressed bytes) would
    cost more than MAX_DECODED_BYTES."""
    for header_class in (nib.Nifti2Header, nib.Nifti1Header):
        size = header_class.template_dtype.itemsize
        if len(head) >= size and header_class.may_contain_header(head[:size]):
            try:
                header = header_class(head[:size], check=False)
                shape = tuple(int(s) for s in header.get_data_shape())
                count = int(np.prod(shape, dtype=object))
                voxels = count * header.get_data_dtype().itemsize
                offset = int(header.get_data_offset())
            except KeyError as exc:
                raise DataError(f"{where}: unreadable (unknown NIfTI datatype code {exc})") from exc
            except _NIBABEL_ERRORS as exc:
                raise DataError(f"{where}: unreadable ({_short(exc)})") from exc
            if voxels > MAX_VOLUME_BYTES:
                raise DataError(f"{where}: header declares a {_fmt(shape)} image ({voxels / 2**30:.3g} GiB), "
                                "far larger than any MRI volume; the header is damaged")
            total = max(offset, size) + max(voxels, 0)
            if total > MAX_VOLUME_BYTES:
                raise DataError(f"{where}: header declares {total} bytes (voxels from byte {offset}), more than any "
                                "MRI volume; the header is damaged")
            cost = decoded_bytes(total, max(count, 0), stored)
            if cost > MAX_DECODED_BYTES:
                raise DataError(f"{where}: header declares a {_fmt(shape)} image of {header.get_data_dtype()}, "
                                f"{cost / 2**30:.3g} GiB to decode (the copies and the float32 array), more than the "
                                f"{MAX_DECODED_BYTES / 2**30:g} GiB allowed for one volume; the file is not read")
            return total
    raise DataError(f"{where}: not a NIfTI file (no NIfTI-1 or NIfTI-2 header)")


def decoded_bytes(file_bytes: int, voxels: int, stored: int = 0) -> int:
    """The memory reading one NIfTI may take at its peak, from its header: the `stored` (compressed) bytes, the
    `file_bytes` it inflates to and nibabel's copy of them, and `_DECODING_BYTES_PER_VOXEL` per voxel."""
    return stored + 2 * file_bytes + _DECODING_BYTES_PER_VOXEL * voxels


def _read_compressed(where: str, file, size: int) -> bytes:
    """A `.nii.gz`'s bytes (`size` of them, as the open file's descriptor said). Its first MiB is read alone and
    its header inflated from it: a file that has none there, or is larger than any compressed form of what the
    header declares, is refused before the rest is read."""
    if size > MAX_VOLUME_BYTES + TRAILING_BYTES_ALLOWED:
        raise DataError(f"{where}: {size} bytes compressed, more than any MRI volume; the file is not read")
    first = file.read(min(size, TRAILING_BYTES_ALLOWED))
    head = _GzipStream(where, first).read(NIFTI_HEADER_BYTES)
    if len(head) < NIFTI_HEADER_BYTES:  # the stream ended within its first MiB: a tiny image, whole in `first`
        return first
    declared = declared_file_bytes(where, head, stored=size)
    if size > declared * _DEFLATE_EXPANSION + 2 * TRAILING_BYTES_ALLOWED:
        raise DataError(f"{where}: {size} bytes compressed for the {declared} bytes its header declares; the "
                        "file is damaged and is not read")
    return first + file.read(size - len(first))


def _read_uncompressed(where: str, file, size: int) -> bytes:
    """A `.nii`'s header and the bytes it declares, no more (what follows is not read)."""
    head = file.read(min(NIFTI_HEADER_BYTES, size))
    return head + file.read(min(max(declared_file_bytes(where, head) - len(head), 0), size - len(head)))


def _image_from_bytes(where: str, payload: bytes):
    """A NIfTI-1 or NIfTI-2 image parsed from a single-file (.nii) byte string."""
    for image_class in (nib.Nifti2Image, nib.Nifti1Image):
        header_class = image_class.header_class
        if header_class.may_contain_header(payload[: header_class.template_dtype.itemsize]):
            try:
                return image_class.from_bytes(payload)
            except _NIBABEL_ERRORS as exc:
                raise DataError(f"{where}: unreadable ({_short(exc)})") from exc
    raise DataError(f"{where}: not a NIfTI file (no NIfTI-1 or NIfTI-2 header)")


def _check_geometry(where: str, img) -> None:
    """The affine (and every set sform/qform) and the voxel spacing must be finite, the spacing positive: a NaN
    compares False with any tolerance, so it would pass the same-grid check and land in meta.json."""
    header = img.header
    forms = [("affine", img.affine)]
    for name in ("sform", "qform"):
        matrix, code = getattr(header, f"get_{name}")(coded=True)
        if code and matrix is not None:
            forms.append((name, matrix))
    for name, matrix in forms:
        if not np.isfinite(np.asarray(matrix, dtype=np.float64)).all():
            raise DataError(f"{where}: non-finite values (NaN or infinity) in the {name}; the header is damaged")
    zooms = np.asarray(header.get_zooms()[:3], dtype=np.float64)
    if not (np.isfinite(zooms).all() and (zooms > 0).all()):
        raise DataError(f"{where}: voxel spacing {'x'.join(str(float(z)) for z in zooms)} (pixdim) is not three "
                        "positive finite numbers; the header is damaged")


def _check_declared_size(where: str, available_bytes: int, img) -> None:
    # nibabel allocates the size the header declares before reading (`declared_file_bytes` capped it): a
    # file shorter than that is truncated.
    declared = int(np.prod([int(s) for s in img.shape], dtype=object)) * img.get_data_dtype().itemsize
    available = available_bytes - int(img.header.get_data_offset())
    if declared > available:
        raise DataError(f"{where}: truncated: the header declares {declared} bytes of voxels, "
                        f"the file holds {max(available, 0)}")


def save_label_nifti(label: np.ndarray, affine: np.ndarray, path: str | os.PathLike,
                     header: nib.Nifti1Header | None = None) -> Path:
    """Write a label map as uint8 .nii.gz with the given affine (and the source header), atomically."""
    target = Path(path)
    if not target.name.endswith(".nii.gz"):
        target = target.with_name(target.name.removesuffix(".nii") + ".nii.gz")
    # gzip level 1: a label map is long runs of a few values, which level 1 stores within a third of level 6's
    # bytes in a sixth of its time (0.04 against 0.21 s for a 240x240x155 case), nnUNetv2_predict's writer being
    # as quick.
    save_nifti(np.asarray(label).astype(np.uint8, copy=False), affine, target, header=header, dtype=np.uint8,
               compresslevel=1)
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


def present_values(raw: np.ndarray) -> np.ndarray:
    """The distinct values of a label map, sorted (np.unique's answer). Non-negative integers below 2**16 are
    counted in one pass (np.bincount), 3.5 times faster than np.unique's sort of the whole volume."""
    if raw.size and raw.dtype.kind in "uib":
        low, high = int(raw.min()), int(raw.max())
        if low >= 0 and high < 2**16:
            return np.flatnonzero(np.bincount(raw.reshape(-1).astype(np.intp, copy=False), minlength=high + 1))
    return np.unique(raw)


def labels_as_uint8(where: str, raw: np.ndarray, spec: ChallengeSpec, case_id: str = "") -> np.ndarray:
    """A segmentation as uint8 raw label values, refused (DataError naming `where`, the unexpected values,
    the table checked and the keys that choose another) if it holds anything outside `spec`'s table."""
    if not (np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating) or raw.dtype == bool):
        raise DataError(f"{where}: segmentation of type {raw.dtype}, expected integer labels")
    if np.issubdtype(raw.dtype, np.floating):
        if not np.isfinite(raw).all():
            raise DataError(f"{where}: non-finite values in the segmentation")
        if not np.array_equal(raw, np.round(raw)):
            raise DataError(f"{where}: non-integer values in the segmentation")
    values = present_values(raw)
    unexpected = [int(v) for v in values.tolist() if int(v) != 0 and int(v) not in spec.labels]
    if unexpected:
        shown = ", ".join(str(v) for v in unexpected[:5])
        kind = "edition" if spec.legacy else "challenge"
        table = ", ".join(map(str, (0, *spec.label_values)))
        raise DataError(f"{where}: labels {{{shown}}} not in the {spec.key} {kind}'s table {{{table}}} "
                        f"({spec.title}); {_other_tables_hint(spec, unexpected, case_id)}")
    return raw.astype(np.uint8)


def to_table_values(where: str, raw: np.ndarray, label_map: dict[int, int | None], spec: ChallengeSpec,
                    description: Path | None) -> np.ndarray:
    """A segmentation in a dataset's own label values -> uint8 in `spec`'s table values (`label_map`, from
    its dataset.json); DataError for a value the dataset.json does not declare or whose class the table lacks."""
    if np.issubdtype(raw.dtype, np.floating) and not (np.isfinite(raw).all() and np.array_equal(raw, np.round(raw))):
        raise DataError(f"{where}: non-integer or non-finite values in the segmentation")
    values = [int(v) for v in np.unique(raw).tolist() if v != 0]
    source = description.name if description is not None else "the dataset's labels"
    undeclared = [v for v in values if v not in label_map]
    if undeclared:
        raise DataError(f"{where}: label {undeclared[0]} is not declared in the labels of {source}")
    absent = [v for v in values if label_map[v] is None]
    if absent:
        raise DataError(f"{where}: label {absent[0]} of {source} names a class the {spec.key} table lacks "
                        f"({spec.describe_labels()}); set data.challenge to the challenge with that class")
    # A table indexed by the declared values themselves, not by a lookup array as long as the largest value: a
    # dataset.json may declare 2^40 (the values present are all declared, so each is found here).
    present = np.array([0, *values], dtype=np.int64)
    table = np.array([0, *(label_map[value] for value in values)], dtype=np.uint8)
    order = np.argsort(present)
    flat = np.asarray(raw).astype(np.int64)
    return table[order][np.searchsorted(present[order], flat)]


def from_table_values(label: np.ndarray, label_map: dict[int, int | None] | None) -> np.ndarray:
    """A label map in table values back in a dataset's own values (the smallest file value of each class);
    unchanged without a map."""
    if label_map is None:
        return label
    lookup = np.arange(256, dtype=np.uint8)
    for file_value, table_value in sorted(label_map.items(), reverse=True):
        if table_value is not None:
            lookup[table_value] = file_value
    return lookup[np.asarray(label).astype(np.uint8)]


def is_foreign_labels(problem: str | None) -> bool:
    """Whether a case's one-line problem is `labels_as_uint8`'s refusal of values outside its table."""
    return problem is not None and re.search(r": labels \{[\d, ]+\} not in the ", problem) is not None


def _other_tables_hint(spec: ChallengeSpec, unexpected: list[int], case_id: str) -> str:
    """Which key forces another table, and which challenges' tables hold the unexpected values (the one
    whose case ids look like this case's first)."""
    if spec.legacy:
        return ("if the folder's labels were renumbered (as nnU-Net's BraTS conversion does), keep its dataset.json "
                "next to imagesTr/ so they are read by their meaning, or set data.edition or data.challenge")
    fitting = [key for key in MODERN_CHALLENGES if set(unexpected) <= set(get_challenge(key).labels)]
    fitting.sort(key=lambda key: not get_challenge(key).matches(case_id))
    suggestion = f"set data.challenge={fitting[0]}" if fitting else "set data.challenge"
    others = f" (tables with these labels: {', '.join(fitting)})" if len(fitting) > 1 else ""
    return f"{suggestion} to check it against another table{others}"


def _fmt(shape) -> str:
    return "x".join(str(int(s)) for s in shape)


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


__all__ = ["AFFINE_TOLERANCE", "SEG", "LoadedCase", "from_table_values", "gunzip_checked", "labels_as_uint8",
           "load_case", "read_volume", "save_label_nifti", "save_nifti", "to_table_values"]
