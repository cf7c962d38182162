"""Fuzzing the NIfTI loader and case validator: whatever the file holds (random shapes including 0-sized and
4D/5D, every NIfTI dtype, NaN/Inf, odd affines, damaged header fields, random bytes, .nii or .nii.gz),
`read_volume` and `load_case` either succeed or raise the project's own error, never anything else.

Bounded: tiny arrays, ~60 examples per property, no deadline (file I/O).
"""

from __future__ import annotations

import gzip
import tempfile
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from brats_swap.data.challenges import CANONICAL_MODALITIES
from brats_swap.data.discovery import Case
from brats_swap.data.nifti import load_case, read_volume
from brats_swap.errors import BratsSwapError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True, database=None)
CASE_ID = "BraTS2021_00042"
ROLES = (*CANONICAL_MODALITIES, "seg")

# Every dtype a NIfTI-1 file can hold, plus bool (stored as uint8, as tools that "save a mask" do).
DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float32, np.float64, np.complex64, np.complex128, np.bool_]
# Header fields and the values worth trying: valid, boundary and damaged.
INTS = [-32768, -1, 0, 1, 2, 3, 4, 5, 7, 8, 64, 256, 32767]
FLOATS = [0.0, -1.0, 1.0, 1e-30, 1e30, 352.0, 1e12, float("nan"), float("inf"), -float("inf")]
DATATYPE_CODES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304, 99, -5]


def _nifti_bytes(data: np.ndarray, affine: np.ndarray, nifti2: bool) -> bytes:
    image_class = nib.Nifti2Image if nifti2 else nib.Nifti1Image
    dtype = np.uint8 if data.dtype == np.bool_ else data.dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return image_class(data.astype(dtype), affine, dtype=dtype).to_bytes()


def _write(folder: Path, role: str, payload: bytes, gz: bool) -> Path:
    path = folder / f"{CASE_ID}_{role}.nii{'.gz' if gz else ''}"
    path.write_bytes(gzip.compress(payload, mtime=0) if gz else payload)
    return path


def _case_with(folder: Path, role: str, payload: bytes, gz: bool, shape) -> Case:
    """A case whose `role` file holds `payload` and whose other files are valid volumes of `shape`
    (so the validator gets past them to the fuzzed one)."""
    rng = np.random.default_rng(0)
    files = {}
    for other in ROLES:
        if other == role:
            files[other] = _write(folder, other, payload, gz)
        else:
            volume = rng.integers(0, 3, shape).astype(np.uint8) * (2 if other == "seg" else 50) + (other != "seg")
            files[other] = _write(folder, other, _nifti_bytes(volume, np.eye(4), False), gz=False)
    seg = files.pop("seg")
    return Case(case_id=CASE_ID, edition="2021", images=files, seg=seg)


def _only_project_errors(call) -> None:
    try:
        call()
    except BratsSwapError as exc:
        message = str(exc)
        assert message and "\n" not in message.strip(), message
        assert CASE_ID in message, message


def _check_everything(folder: Path, role: str, payload: bytes, gz: bool, shape) -> None:
    case = _case_with(folder, role, payload, gz, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _only_project_errors(lambda: read_volume(CASE_ID, case.files[role]))
        _only_project_errors(lambda: read_volume(CASE_ID, case.files[role], as_float=False))
        _only_project_errors(lambda: load_case(case))


shapes = st.lists(st.integers(0, 3), min_size=0, max_size=5).map(tuple)
finite_or_not = st.floats(allow_nan=True, allow_infinity=True, width=32)
affines = st.one_of(
    st.just(np.eye(4)),
    hnp.arrays(np.float64, (4, 4), elements=st.floats(-1e6, 1e6, allow_nan=False, width=32)),
    hnp.arrays(np.float64, (4, 4), elements=finite_or_not),
)


@FUZZ
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    affine=affines,
    role=st.sampled_from(ROLES),
    gz=st.booleans(),
    nifti2=st.booleans(),
)
def test_random_arrays(data, dtype, shape, affine, role, gz, nifti2):
    array = data.draw(hnp.arrays(dtype, shape), label="array")
    if role == "seg" and data.draw(st.booleans(), label="label values"):
        array = data.draw(hnp.arrays(np.int16, shape, elements=st.sampled_from([0, 1, 2, 3, 4, 5, -1, 255])))
    try:
        payload = _nifti_bytes(array, affine, nifti2)
    except Exception:  # nibabel cannot even write it (e.g. a 0-d array): nothing to load
        return
    reference = shape if len(shape) == 3 and 0 not in shape else (3, 3, 3)
    with tempfile.TemporaryDirectory() as folder:
        _check_everything(Path(folder), role, payload, gz, reference)


@FUZZ
@given(
    dtype=st.sampled_from(DTYPES),
    values=st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, -1, 255, 260, 1.5, 1e30, float("nan"), float("inf"), 2 + 1j]),
                    min_size=1, max_size=4),
    gz=st.booleans(),
)
def test_random_label_maps(dtype, values, gz):
    """Segmentations of every dtype and odd label values: a clean error naming the labels, or a label map."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        labels = np.resize(np.array(values), (3, 3, 3)).astype(dtype)
    with tempfile.TemporaryDirectory() as folder:
        _check_everything(Path(folder), "seg", _nifti_bytes(labels, np.eye(4), False), gz, (3, 3, 3))


def _damaged_header(fields: dict) -> bytes:
    """A valid 3x3x3 int16 NIfTI-1 file with some header fields overwritten by raw values."""
    base = bytearray(_nifti_bytes(np.arange(27, dtype=np.int16).reshape(3, 3, 3) + 1, np.eye(4), False))
    header = np.frombuffer(bytes(base[:348]), dtype=nib.nifti1.header_dtype).copy()
    for name, value in fields.items():
        header[name] = value
    base[:348] = header.tobytes()
    return bytes(base)


header_fields = st.fixed_dictionaries({}, optional={
    "sizeof_hdr": st.sampled_from([348, 540, 0, -1, 1 << 20]),
    "dim": st.lists(st.sampled_from(INTS), min_size=8, max_size=8),
    "datatype": st.sampled_from(DATATYPE_CODES),
    "bitpix": st.sampled_from([0, 1, 8, 16, 32, 64, 128, -8]),
    "vox_offset": st.sampled_from(FLOATS),
    "scl_slope": st.sampled_from(FLOATS),
    "scl_inter": st.sampled_from(FLOATS),
    "pixdim": st.lists(st.sampled_from(FLOATS), min_size=8, max_size=8),
    "qform_code": st.sampled_from(INTS),
    "sform_code": st.sampled_from(INTS),
    "quatern_b": st.sampled_from(FLOATS),
    "quatern_c": st.sampled_from(FLOATS),
    "quatern_d": st.sampled_from(FLOATS),
    "srow_x": st.lists(st.sampled_from(FLOATS), min_size=4, max_size=4),
    "srow_z": st.lists(st.sampled_from(FLOATS), min_size=4, max_size=4),
    "magic": st.sampled_from([b"n+1", b"ni1", b"n+2", b"\x00\x00\x00", b"xyz"]),
    "dim_info": st.integers(0, 255),
    "xyzt_units": st.integers(0, 255),
})


@FUZZ
@given(fields=header_fields, role=st.sampled_from(ROLES), gz=st.booleans(),
       cut=st.sampled_from([None, 0, 100, 348, 352, 380]))
def test_damaged_headers(fields, role, gz, cut):
    payload = _damaged_header(fields)
    if cut is not None:
        payload = payload[:cut]
    with tempfile.TemporaryDirectory() as folder:
        _check_everything(Path(folder), role, payload, gz, (3, 3, 3))


@FUZZ
@given(payload=st.binary(max_size=1500), role=st.sampled_from(ROLES), gz=st.booleans(),
       prefix=st.sampled_from([b"", b"\x5c\x01\x00\x00", b"\x1f\x8b"]))
def test_random_bytes(payload, role, gz, prefix):
    with tempfile.TemporaryDirectory() as folder:
        _check_everything(Path(folder), role, prefix + payload, gz, (3, 3, 3))


@pytest.mark.parametrize("gz", [False, True], ids=["nii", "nii.gz"])
def test_header_declaring_a_huge_image_is_refused_without_allocating_it(tmp_path, gz):
    # 32767³ int16 voxels is 64 TiB: reading it must fail on the header, not on a MemoryError (or, for
    # sizes that do fit in RAM, after allocating gigabytes for a file of a few hundred bytes).
    payload = _damaged_header({"dim": [3, 32767, 32767, 32767, 1, 1, 1, 1]})
    path = _write(tmp_path, "t1", payload, gz)
    with pytest.raises(BratsSwapError, match=f"case {CASE_ID}: file {path.name}"):
        read_volume(CASE_ID, path)


def test_complex_valued_image_is_refused(tmp_path):
    # nibabel's get_fdata would silently drop the imaginary part; an MRI modality is real-valued.
    volume = (np.arange(27).reshape(3, 3, 3) + 1) * (1 + 2j)
    case = _case_with(tmp_path, "t2", _nifti_bytes(volume.astype(np.complex64), np.eye(4), False), False, (3, 3, 3))
    with pytest.raises(BratsSwapError, match=f"case {CASE_ID}: file {case.images['t2'].name}: .*complex"):
        load_case(case)
