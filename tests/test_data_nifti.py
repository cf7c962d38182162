from __future__ import annotations

import gzip
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from data_helpers import AFFINE, SHAPE, write_case, write_volume
from typer.testing import CliRunner

from brats_swap.cli.data import app as data_app
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case, save_label_nifti
from brats_swap.errors import DataError

runner = CliRunner()
CASE = "BraTS2021_00000"


def _check(folder, *extra):
    return runner.invoke(data_app, ["check", str(folder), *extra])


def test_load_case_keeps_channel_order_affine_and_header(tmp_path):
    write_case(tmp_path, CASE, "2021")
    (case,) = discover_cases(tmp_path)
    loaded = load_case(case)
    assert loaded.image.dtype == np.float32 and loaded.image.shape == (4, *SHAPE)
    # data_helpers gives channel c a brain of intensity ~100 * (c + 1): t1, t1ce, t2, flair.
    means = [loaded.image[c][loaded.image[c] != 0].mean() for c in range(4)]
    assert np.allclose(means, [100, 200, 300, 400], atol=5)
    assert loaded.seg.dtype == np.uint8 and set(np.unique(loaded.seg)) == {0, 1, 2, 4}
    assert np.allclose(loaded.affine, AFFINE)
    assert loaded.spacing == (1.0, 1.0, 1.0)
    reordered = load_case(case, ("flair", "t1"))
    assert np.array_equal(reordered.image[0], loaded.image[3])


def test_save_label_nifti_round_trip_is_atomic_and_deterministic(tmp_path):
    write_case(tmp_path, CASE, "2021")
    (case,) = discover_cases(tmp_path)
    loaded = load_case(case)
    out = save_label_nifti(loaded.seg, loaded.affine, tmp_path / "pred" / f"{CASE}.nii", header=loaded.header)
    assert out.name == f"{CASE}.nii.gz"
    img = nib.load(str(out))
    assert img.get_data_dtype() == np.uint8
    assert np.array_equal(np.asanyarray(img.dataobj), loaded.seg)
    assert np.allclose(img.affine, loaded.affine)
    assert img.header.get_zooms() == loaded.header.get_zooms()
    first = out.read_bytes()
    save_label_nifti(loaded.seg, loaded.affine, out, header=loaded.header)
    assert out.read_bytes() == first
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp files left behind


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path):
    path.write_bytes(b"this is not a nifti file" * 20)


def _four_d(path):
    write_volume(path, np.ones((*SHAPE, 2), dtype=np.float32))


def _other_shape(path):
    write_volume(path, np.ones((SHAPE[0], SHAPE[1], SHAPE[2] + 2), dtype=np.float32))


def _shifted_affine(path):
    data = nib.load(str(path)).get_fdata(dtype=np.float32)
    moved = AFFINE.copy()
    moved[0, 3] += 0.5
    write_volume(path, data, moved)


def _nan(path):
    data = nib.load(str(path)).get_fdata(dtype=np.float32)
    data[3, 3, 3] = np.nan
    write_volume(path, data)


def _zeros(path):
    write_volume(path, np.zeros(SHAPE, dtype=np.float32))


def _bad_label(path):
    seg = np.asanyarray(nib.load(str(path)).dataobj).copy()
    seg[2, 2, 2] = 3
    write_volume(path, seg)


def _seg_other_shape(path):
    write_volume(path, np.zeros((SHAPE[0] + 1, SHAPE[1], SHAPE[2]), dtype=np.uint8))


@pytest.mark.parametrize(("role", "damage", "problem"), [
    ("t2", _truncate, "unreadable"),
    ("flair", _garbage, "not a NIfTI file"),
    ("t1", _four_d, "4D image of shape 20x18x14x2"),
    ("t2", _other_shape, "shape 20x18x16 differs from BraTS2021_00000_t1.nii.gz 20x18x14"),
    ("t2", _shifted_affine, "affine differs from BraTS2021_00000_t1.nii.gz"),
    ("flair", _nan, "1 non-finite voxels"),
    ("t1ce", _zeros, "every voxel is zero"),
    ("seg", _bad_label, "labels {3} not in the 2021 edition's table {0, 1, 2, 4}"),
    ("seg", _seg_other_shape, "segmentation shape 21x18x14 differs"),
])
def test_each_validation_error_names_case_file_and_problem(tmp_path, role, damage, problem):
    paths = write_case(tmp_path, CASE, "2021")
    damage(paths[role])
    result = _check(tmp_path, "--strict")
    assert result.exit_code == 1, result.output
    assert f"case {CASE}: file {paths[role].name}: " in result.output
    assert problem in result.output
    with pytest.raises(DataError, match="^case BraTS2021_00000: file "):
        load_case(discover_cases(tmp_path)[0])


def test_missing_modality_names_the_expected_file(tmp_path):
    write_case(tmp_path, "BraTS-GLI-00003-000", "2023", skip=("t1ce",))
    result = _check(tmp_path, "--strict")
    assert result.exit_code == 1
    assert "case BraTS-GLI-00003-000: missing modality t1ce (expected file BraTS-GLI-00003-000-t1c.nii.gz)" \
        in " ".join(result.output.split())


def _one_line(result) -> str:
    return " ".join(result.output.split())


def test_2023_labels_are_checked_against_their_own_table(tmp_path):
    paths = write_case(tmp_path, "BraTS-GLI-00000-000", "2023")
    seg = np.asanyarray(nib.load(str(paths["seg"])).dataobj).copy()
    seg[1, 1, 1] = 4  # ET of 2017-2021 and RC of the post-treatment release, not a GLI pre-op label
    write_volume(paths["seg"], seg)
    result = _check(tmp_path, "--strict")
    assert result.exit_code == 1
    line = _one_line(result)
    assert ("file BraTS-GLI-00000-000-seg.nii.gz: labels {4} not in the gli challenge's table {0, 1, 2, 3} "
            "(GLI pre-operative glioma (2023)); set data.challenge=gli-post") in line
    assert _check(tmp_path, "--strict", "--challenge", "gli-post").exit_code == 0


@pytest.mark.parametrize(("edition", "case_id", "bad", "suggested"), [
    ("ped", "BraTS-PED-00001-000", 5, "data.challenge"),
    ("men-rt", "BraTS-MEN-RT-0060-1", 2, "data.challenge=gli "),
    ("met", "BraTS-MET-00132-000", 7, "data.challenge"),
    ("men", "BraTS-MEN-00004-000", 4, "data.challenge=gli-post"),
])
def test_a_label_outside_the_detected_challenge_names_file_labels_table_and_key(tmp_path, edition, case_id, bad,
                                                                               suggested):
    paths = write_case(tmp_path, case_id, edition)
    seg = np.asanyarray(nib.load(str(paths["seg"])).dataobj).copy()
    seg[1, 1, 1] = bad
    write_volume(paths["seg"], seg)
    result = _check(tmp_path, "--strict", "--set", f"data.modalities=[{','.join(sorted(paths.keys() - {'seg'}))}]")
    assert result.exit_code == 1
    line = _one_line(result)
    assert f"error: case {case_id}: file {paths['seg'].name}: labels {{{bad}}} not in the {edition} challenge's" \
        in line
    assert suggested in line


def test_men_rt_reads_t1c_alone_and_says_so_when_other_modalities_are_asked_for(tmp_path):
    write_case(tmp_path, "BraTS-MEN-RT-0060-1", "men-rt")
    result = _check(tmp_path, "--strict", "--set", "data.modalities=[t1,t1ce]")
    assert result.exit_code == 1
    assert ("case BraTS-MEN-RT-0060-1: the men-rt challenge ships no t1 image (only t1ce): "
            "set data.modalities=[t1ce]") in _one_line(result)
    result = _check(tmp_path, "--strict")  # data.modalities unset: the challenge's images, t1ce alone
    assert result.exit_code == 0, result.output
    loaded = load_case(discover_cases(tmp_path, modalities=["t1ce"])[0], ["t1ce"])
    assert loaded.image.shape == (1, *SHAPE) and set(np.unique(loaded.seg)) == {0, 1}
    assert "GTV [1]" in _one_line(result)  # the label table of the detected challenge is shown


def test_without_strict_bad_cases_are_listed_and_skipped(tmp_path):
    write_case(tmp_path, "BraTS2021_00001", "2021")
    bad = write_case(tmp_path, "BraTS2021_00002", "2021")
    _nan(bad["t1"])
    result = _check(tmp_path, "--workers", "1")  # one process: the pool is tests/test_data_scale.py's
    assert result.exit_code == 0, result.output
    assert "1 usable, 1 skipped" in result.output
    assert "non-finite" in result.output
    _nan(write_case(tmp_path, "BraTS2021_00001", "2021")["t2"])  # now every case is bad
    assert _check(tmp_path, "--workers", "1").exit_code == 1


def test_empty_folder_and_gzip_without_end_are_exit_1(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _check(tmp_path / "empty")
    assert result.exit_code == 1 and "empty folder" in result.output
    paths = write_case(tmp_path / "data", CASE, "2021")
    raw = gzip.decompress(paths["t1"].read_bytes())
    paths["t1"].write_bytes(gzip.compress(raw[: len(raw) - 100]))  # valid gzip, data cut short
    result = _check(tmp_path / "data", "--strict")
    assert result.exit_code == 1 and "BraTS2021_00000_t1.nii.gz: unreadable" in result.output


def test_unreadable_file_is_a_data_error(tmp_path, monkeypatch):
    paths = write_case(tmp_path, CASE, "2021")
    paths["flair"].chmod(0)
    if os.geteuid() == 0:  # root reads any file: make the permission check see what a user would
        import brats_swap.data.nifti as nifti_module

        real_access = os.access
        monkeypatch.setattr(nifti_module.os, "access",
                            lambda path, mode: False if Path(path) == paths["flair"] else real_access(path, mode))
    try:
        result = _check(tmp_path, "--strict")
    finally:
        paths["flair"].chmod(0o644)
    assert result.exit_code == 1
    assert f"case {CASE}: file {paths['flair'].name}: permission denied" in result.output


def test_edition_option_is_validated_and_forces_the_table(tmp_path):
    write_case(tmp_path, CASE, "2021")
    result = _check(tmp_path, "--edition", "2016")
    assert result.exit_code == 2 and "data.edition" in result.output
    # Forced 2023: its file names (t1n, t1c, ...) are not the 2021 ones, so the modalities are missing.
    result = _check(tmp_path, "--edition", "2023", "--strict")
    assert result.exit_code == 1 and "missing modality t1" in result.output
    result = _check(tmp_path, "--challenge", "pediatric")
    assert result.exit_code == 2 and "data.challenge" in result.output


def test_data_commands_are_registered_on_the_main_app(tmp_path):
    from brats_swap.cli.main import app

    write_case(tmp_path, CASE, "2021")
    result = runner.invoke(app, ["data", "check", str(tmp_path), "--strict"])
    assert result.exit_code == 0, result.output
    assert CASE in result.output and "ok" in result.output


def _gz_members(payload: bytes, parts: int) -> bytes:
    step = len(payload) // parts + 1
    return b"".join(gzip.compress(payload[i:i + step], mtime=0) for i in range(0, len(payload), step))


def test_gzip_crc_and_length_are_checked_before_any_voxel_is_used(tmp_path):
    paths = write_case(tmp_path, CASE, "2021")
    stored = paths["t2"].read_bytes()
    payload = gzip.decompress(stored)
    (case,) = discover_cases(tmp_path)
    expected = load_case(case).image
    # Several gzip members (what `cat a.gz b.gz` or some writers give) and trailing zero padding are valid.
    paths["t2"].write_bytes(_gz_members(payload, 3) + b"\0" * 7)
    assert np.array_equal(load_case(case).image, expected)
    damaged_files = [
        stored[:-8] + bytes([stored[-8] ^ 1]) + stored[-7:],  # the CRC-32 of the trailer
        stored[:-4] + bytes([stored[-4] ^ 1]) + stored[-3:],  # the length (ISIZE) of the trailer
        stored + b"junk",  # garbage after the stream
        _gz_members(payload, 2)[:-20],  # the last member cut short
    ]
    for damaged in damaged_files:
        paths["t2"].write_bytes(damaged)
        with pytest.raises(DataError, match=f"^case {CASE}: file {paths['t2'].name}: "
                                            "(damaged gzip data|unreadable or truncated)"):
            load_case(case)
    paths["t2"].write_bytes(payload)  # a .nii.gz that is not gzip at all
    with pytest.raises(DataError, match="not a NIfTI file .no gzip header"):
        load_case(case)
