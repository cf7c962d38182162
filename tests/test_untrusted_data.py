"""Other people's datasets and challenge input, read as an attacker would write them (issue 31, the data half).

A dataset.json's keys and paths, file and folder names, NIfTI headers and symlinked folders come from someone
else: none of them may delete, rename or write anything outside brats-swap's own cache and output folders,
allocate more than the header declares, or hang a walk. Each refusal is one line naming the file.
Tests that could exhaust memory or hang on a regression run in a subprocess under a memory rlimit and a timeout.
"""

from __future__ import annotations

import gzip
import os
import subprocess

import nibabel as nib
import numpy as np
import pytest
import torch
from data_helpers import brain_volumes, write_case, write_volume
from layout_helpers import write_json
from typer.testing import CliRunner
from untrusted_helpers import read_volumes_capped, run_capped

from brats_swap.cli.main import app
from brats_swap.config import Config, DataConfig
from brats_swap.data.cache import CacheWriteError, list_prepared, prepare_dataset
from brats_swap.data.discovery import Case, discover_cases
from brats_swap.errors import DataError
from brats_swap.evaluate.predicting import Predictor, predict_case, predict_with
from brats_swap.ship.serve import case_folders, serve

SHAPE = (16, 16, 16)
CHANNELS = {"0": "T1", "1": "T1ce", "2": "T2", "3": "Flair"}
# nnU-Net's BraTS 2021 conversion declares regions only (1 edema, 2 necrosis, 3 enhancing).
LABELS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]}


def _data_config() -> DataConfig:
    return DataConfig(cube=list(SHAPE), prepare_workers=1)


def _dataset_json(folder, cases: dict | None = None, channels: dict = CHANNELS) -> None:
    """An nnU-Net v2 dataset.json; with `cases`, its `dataset` entry listing each case's files."""
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    content = {"channel_names": channels, "labels": LABELS, "file_ending": ".nii.gz"}
    write_json(folder / "dataset.json", content | ({"dataset": cases} if cases is not None else {}))


def _channel_files(folder, stem: str, seed: int = 0) -> list[str]:
    """Four channel files `imagesTr/<stem>_000k.nii.gz` of a small brain; their paths relative to `folder`."""
    images, _ = brain_volumes(SHAPE, seed)
    names = [f"imagesTr/{stem}_{k:04d}.nii.gz" for k in range(4)]
    for name, volume in zip(names, images, strict=True):
        write_volume(folder / name, volume)
    return [f"./{name}" for name in names]


def _tiny_predictor() -> Predictor:
    config = Config(data=_data_config())
    torch.manual_seed(0)
    model = torch.nn.Conv3d(4, 3, kernel_size=1)  # 3 outputs: the legacy labels' channels
    return Predictor(config, [(model, config)], torch.device("cpu"), None, None, "a 1x1x1 convolution")


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# --- dataset.json keys and paths -----------------------------------------------------------------------------


def test_dataset_json_keys_cannot_rename_or_delete_folders_outside_the_cache(tmp_path):
    """The issue's attack: keys `/abs/victim` and `../victim` whose image fails to decode made `data prepare`
    rename and delete both victim folders (`_remove_entry(cache_dir / case_id)`)."""
    victims = [tmp_path / "victim-absolute", tmp_path / "victim-up"]
    for victim in victims:
        victim.mkdir()
        (victim / "important.txt").write_text("keep me")
    dataset = tmp_path / "Dataset001_Hostile"
    (dataset / "imagesTr").mkdir(parents=True)
    (dataset / "imagesTr" / "broken.nii.gz").write_bytes(b"this does not decode")
    entry = {"images": ["./imagesTr/broken.nii.gz"] * 4}
    for key in (str(victims[0]), "../victim-up"):
        _dataset_json(dataset, {key: entry})
        with pytest.raises(DataError) as caught:
            prepare_dataset(dataset, tmp_path / "cache", _data_config(), progress=False)
        message = _one_line(caught.value)
        assert message.startswith(f"{dataset / 'dataset.json'}: dataset entry {key!r}") and "separator" in message
    for victim in victims:
        assert (victim / "important.txt").read_text() == "keep me"


def test_image_and_label_paths_of_a_dataset_entry_stay_inside_the_dataset_folder(tmp_path):
    dataset = tmp_path / "Dataset002_Paths"
    inside = _channel_files(dataset, "case_1")
    (tmp_path / "outside.nii.gz").write_bytes((dataset / inside[0]).read_bytes())
    os.symlink(tmp_path / "outside.nii.gz", dataset / "imagesTr" / "link.nii.gz")
    for where, bad, problem in [("image", "../outside.nii.gz", "leads outside"),
                                ("image", str(tmp_path / "outside.nii.gz"), "is absolute"),
                                ("image", "./imagesTr/link.nii.gz", "leads outside"),
                                ("label", "../outside.nii.gz", "leads outside")]:
        entry = {"images": [bad, *inside[1:]]} if where == "image" else {"images": inside, "label": bad}
        _dataset_json(dataset, {"case_1": entry})
        with pytest.raises(DataError) as caught:
            discover_cases(dataset)
        message = _one_line(caught.value)
        assert f"dataset entry 'case_1': {where} {bad!r} {problem}" in message, message
    _dataset_json(dataset, {"case_1": {"images": inside}})
    assert discover_cases(dataset)[0].images["t1"] == (dataset / inside[0]).resolve()


def test_a_file_name_that_is_no_case_id_is_one_line_naming_the_file(tmp_path):
    write_case(tmp_path / "raw", "BraTS2021_00000", "2021", shape=SHAPE)
    bad = write_volume(tmp_path / "raw" / "BraTS 2021\n00001_t1.nii.gz", brain_volumes(SHAPE)[0][0])
    with pytest.raises(DataError) as caught:
        discover_cases(tmp_path / "raw")
    assert _one_line(caught.value) == (f"{bad.parent}: file {bad.name!r}: case id 'BraTS 2021\\n00001' holds a "
                                       "control character")


def test_a_channel_key_that_is_not_a_number_is_one_line(tmp_path):
    dataset = tmp_path / "Dataset003_Channels"
    _channel_files(dataset, "case_1")
    _dataset_json(dataset, channels={"zero": "T1", "1": "T1ce", "2": "T2", "3": "Flair"})
    with pytest.raises(DataError) as caught:
        discover_cases(dataset)
    assert _one_line(caught.value) == (f"{dataset / 'dataset.json'}: channel key 'zero' is not a channel number "
                                       '(expected "0", "1", ...)')


# --- the cache touches only what it wrote --------------------------------------------------------------------


def test_the_cache_never_replaces_or_removes_a_folder_it_did_not_write(tmp_path):
    good_root, bad_root, cache = tmp_path / "good", tmp_path / "bad", tmp_path / "cache"
    write_case(good_root, "BraTS2021_00000", "2021", shape=SHAPE)
    write_case(bad_root, "BraTS2021_00001", "2021", shape=SHAPE, seed=1)["t1"].write_bytes(b"broken")
    users = [cache / "BraTS2021_00000", cache / "BraTS2021_00001", cache / ".tmp-notes", cache / ".old-drafts-1-x"]
    for folder in users:  # the user's own folders, named like entries and temp folders
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("mine")
    stale = cache / ".tmp-BraTS2021_00009-999999999-0123abcd"  # an interrupted write of the cache (pid gone)
    stale.mkdir()

    report = prepare_dataset(bad_root, cache, _data_config(), progress=False)  # the case fails to decode
    assert list(report.failed) == ["BraTS2021_00001"]
    for folder in users:
        assert (folder / "notes.txt").read_text() == "mine", folder
    with pytest.raises(CacheWriteError) as caught:  # a good case whose entry would replace the user's folder
        prepare_dataset(good_root, cache, _data_config(), progress=False)
    assert "BraTS2021_00000 is there but was not written by brats-swap" in _one_line(caught.value)
    for folder in users:
        assert (folder / "notes.txt").read_text() == "mine", folder
    assert not stale.exists()

    # The cache's own stale entry of a case that is now bad is still removed, and a good one replaced.
    (cache / "BraTS2021_00000" / "notes.txt").unlink()
    (cache / "BraTS2021_00000").rmdir()
    assert prepare_dataset(good_root, cache, _data_config(), progress=False).prepared == ["BraTS2021_00000"]
    write_case(good_root, "BraTS2021_00000", "2021", shape=SHAPE)["t1"].write_bytes(b"broken now")
    report = prepare_dataset(good_root, cache, _data_config(), progress=False)
    assert list(report.failed) == ["BraTS2021_00000"] and not (cache / "BraTS2021_00000").exists()


def test_a_listed_image_that_is_missing_skips_its_case_with_a_warning_and_fails_with_strict(tmp_path):
    dataset = tmp_path / "Dataset004_Missing"
    good = _channel_files(dataset, "case_1")
    gone = [*_channel_files(dataset, "case_2", seed=1)[:3], "./imagesTr/case_2_0003.nii.gz"]
    (dataset / gone[3]).unlink()
    _dataset_json(dataset, {"case_1": {"images": good}, "case_2": {"images": gone}})
    report = prepare_dataset(dataset, tmp_path / "cache", _data_config(), progress=False)
    assert report.prepared == ["case_1"] and list(report.failed) == ["case_2"]
    assert list_prepared(tmp_path / "cache") == ["case_1"]
    with pytest.raises(DataError, match="case case_2: file case_2_0003.nii.gz: cannot stat"):
        prepare_dataset(dataset, tmp_path / "cache", _data_config(), strict=True, progress=False)
    result = CliRunner().invoke(app, ["data", "prepare", str(dataset), "--out", str(tmp_path / "cli-cache"),
                                      "--set", "data.cube=[16,16,16]", "--set", "data.prepare_workers=1"])
    assert result.exit_code == 0, result.output
    assert "skipped case_2: case case_2: file case_2_0003.nii.gz: cannot stat" in " ".join(result.output.split())


# --- predictions and serve-challenge write only inside their output ------------------------------------------


def test_predictions_are_written_only_inside_the_output_folder(tmp_path):
    predictor = _tiny_predictor()
    dataset = tmp_path / "Dataset005_Predict"
    images = _channel_files(dataset, "case_1")
    victim = tmp_path / "victim.nii.gz"
    victim.write_bytes(b"precious")
    _dataset_json(dataset, {str(tmp_path / "victim"): {"images": images}})
    with pytest.raises(DataError, match="dataset entry .* holds a path separator"):
        predict_with(predictor, dataset, tmp_path / "out", probabilities=True, progress=False)
    assert victim.read_bytes() == b"precious" and not (tmp_path / "victim.npz").exists()

    # Whatever found the case: the writer itself keeps its files inside `out`.
    files = {m: (dataset / p).resolve() for m, p in zip(("t1", "t1ce", "t2", "flair"), images, strict=True)}
    for case_id in ("../escaped", str(tmp_path / "escaped")):
        case = Case(case_id=case_id, edition="2017", images=files, seg=None)
        with pytest.raises(DataError):
            predict_case(case, predictor.config, predictor.members, predictor.device, tmp_path / "out", tta=False,
                         plan=None, probabilities=True, say=None)
    assert not list(tmp_path.glob("escaped*"))
    case = Case(case_id="case_1", edition="2017", images=files, seg=None)
    written = predict_case(case, predictor.config, predictor.members, predictor.device, tmp_path / "out",
                           tta=False, plan=None, probabilities=True, say=None)
    assert written == (tmp_path / "out" / "case_1.nii.gz").resolve() and (tmp_path / "out" / "case_1.npz").is_file()


def test_serve_challenge_refuses_a_case_folder_whose_dataset_json_points_outside_the_output(tmp_path):
    """The issue's serve-challenge route: a dataset.json inside a case folder named the output file."""
    input_dir, output_dir = tmp_path / "input", tmp_path / "serve" / "out"
    write_case(input_dir, "BraTS2021_00000", "2021", shape=SHAPE, seg=False)
    hostile = input_dir / "BraTS2021_00001"
    _dataset_json(hostile, {"../../escaped": {"images": _channel_files(hostile, "x")}})
    lines: list[str] = []
    report = serve(_tiny_predictor(), input_dir, output_dir, tta=False, say=lines.append)
    assert [p.name for p in report.written] == ["BraTS2021_00000.nii.gz"]
    assert list(report.failures.reasons) == ["BraTS2021_00001"]
    assert "'../../escaped' holds a path separator" in _one_line(DataError(report.failures.describe()))
    assert not list(tmp_path.rglob("escaped*"))


# --- walks: each real folder once ----------------------------------------------------------------------------

def _run_capped(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_capped(script, *args, timeout=timeout, hang="a walk that does not end")


def test_symlink_loops_in_a_dataset_neither_hang_nor_repeat_a_case(tmp_path):
    """The issue's loop: two case folders each holding `up -> ..` made `data check` grow without end."""
    for number in range(2):
        folder = tmp_path / f"BraTS2021_0000{number}"
        write_case(tmp_path, folder.name, "2021", shape=(4, 4, 4), seed=number)
        os.symlink("..", folder / "up")
    result = _run_capped("""
        import sys
        from pathlib import Path
        from brats_swap.data.discovery import discover_cases
        root = Path(sys.argv[1])
        print(*[case.case_id for case in discover_cases(root)])
        for folder in sorted(root.iterdir()):  # what serve-challenge walks: one case folder at a time
            print(folder.name, len(discover_cases(folder)))
        """, str(tmp_path), timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["BraTS2021_00000 BraTS2021_00001", "BraTS2021_00000 2", "BraTS2021_00001 2"]


def test_the_challenge_input_lists_each_real_case_folder_once(tmp_path):
    write_case(tmp_path, "BraTS-GLI-00000-000", "gli", shape=(4, 4, 4))
    os.symlink("BraTS-GLI-00000-000", tmp_path / "alias")
    os.symlink(".", tmp_path / "self")
    assert case_folders(tmp_path) == [tmp_path / "BraTS-GLI-00000-000"]


# --- NIfTI sizes: the header bounds the inflating ------------------------------------------------------------


def test_a_small_nii_gz_that_unpacks_to_a_gibibyte_is_refused_without_allocating_it(tmp_path):
    """1 MB on disk, 1 GiB inflated: refused having inflated about its header's size, under a memory cap that
    inflating the whole file would break (the issue measured a 2.4 GB peak)."""
    zeros = gzip.compress(bytes(16 * 2**20), mtime=0)  # one 16 MiB member of zeros, ~16 KB compressed
    small = nib.Nifti1Image(np.ones((16, 16, 16), dtype=np.uint8), np.eye(4))
    huge = nib.Nifti1Header()
    huge.set_data_shape((4096, 4096, 4096))
    huge.set_data_dtype(np.float32)
    bombs = {"small": gzip.compress(small.to_bytes(), mtime=0) + zeros * 64,  # header: 4 KiB of voxels
             "huge": gzip.compress(huge.binaryblock + b"\0" * 4, mtime=0) + zeros * 64}  # header: 256 GiB
    for name, content in bombs.items():
        (tmp_path / f"{name}.nii.gz").write_bytes(content)
        assert len(content) < 2**20
    # 256 MiB of address space: far below the 1 GiB the file inflates to
    assert read_volumes_capped(tmp_path, "bomb", ["small", "huge"], 256 * 2**20) == [
        "case bomb: file small.nii.gz: decompresses to more than the 4448 bytes its header declares; the file is "
        "damaged and is not read",
        "case bomb: file huge.nii.gz: header declares a 4096x4096x4096 image (256 GiB), far larger than any MRI "
        "volume; the header is damaged"]
