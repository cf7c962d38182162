"""Bad data: every foreseeable problem with a case is exit 1 and one `error:` line naming the case, the file
and the problem, without a traceback; `--debug` shows it. Without --strict, bad cases are listed and skipped.
"""

from __future__ import annotations

import errno
import gzip
import shutil

import numpy as np
import pytest
from failure_helpers import DAMAGES, damage_nan, error_line, invoke

from brats_swap.errors import EXIT_BAD_INPUT

PREPARE_SETTINGS = ["--set", "data.cube=[32,32,32]", "--workers", "1"]


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_check_and_prepare_strict_name_case_file_and_problem(one_case, tmp_path, damage):
    root, case_id = one_case
    damage_fn, words = DAMAGES[damage]
    file_name = damage_fn(root / case_id)

    check = invoke("data", "check", "--strict", root)
    error_line(check, EXIT_BAD_INPUT, f"case {case_id}", file_name, *words)

    cache = tmp_path / "cache"
    prepare = invoke("data", "prepare", root, "--out", cache, "--strict", *PREPARE_SETTINGS)
    error_line(prepare, EXIT_BAD_INPUT, f"case {case_id}", file_name, *words)
    assert not (cache / case_id).exists()


def test_bad_case_is_skipped_without_strict(phantom_root, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(phantom_root, root)
    bad_id = sorted(p.name for p in root.iterdir())[1]
    damage_nan(root / bad_id)

    check = invoke("data", "check", root, "--workers", "1")
    assert check.exit_code == 0, check.output
    assert "3 usable, 1 skipped" in check.output and "non-finite" in check.output

    cache = tmp_path / "cache"
    prepare = invoke("data", "prepare", root, "--out", cache, *PREPARE_SETTINGS)
    assert prepare.exit_code == 0, prepare.output
    assert f"skipped {bad_id}" in prepare.output
    from brats_swap.data.cache import list_prepared

    prepared = list_prepared(cache)
    assert len(prepared) == 3 and bad_id not in prepared


def test_nonexistent_and_empty_folders(tmp_path):
    missing = tmp_path / "nowhere"
    error_line(invoke("data", "check", missing), EXIT_BAD_INPUT, str(missing), "not found")
    error_line(invoke("data", "prepare", missing, "--out", tmp_path / "c"), EXIT_BAD_INPUT, str(missing), "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    error_line(invoke("data", "check", empty), EXIT_BAD_INPUT, str(empty), "empty folder")
    error_line(invoke("data", "prepare", empty, "--out", tmp_path / "c"), EXIT_BAD_INPUT, str(empty), "empty folder")
    a_file = tmp_path / "file.nii.gz"
    a_file.write_bytes(b"x")
    error_line(invoke("data", "check", a_file), EXIT_BAD_INPUT, str(a_file), "not a folder")


def test_folder_of_non_brats_names(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "patient7.nii.gz").write_bytes(b"x")
    error_line(invoke("data", "check", folder), EXIT_BAD_INPUT, "no BraTS-named", "patient7.nii.gz")


def test_duplicate_case_ids(one_case):
    root, case_id = one_case
    shutil.copytree(root / case_id, root / "LGG" / case_id)  # the same case in two places
    line = error_line(invoke("data", "check", root), EXIT_BAD_INPUT, f"case {case_id}", "duplicate")
    assert str(root / case_id) in line and str(root / "LGG" / case_id) in line
    # .nii next to .nii.gz of the same modality is a duplicate too
    (root / "LGG").rename(root.parent / "elsewhere")
    flair = root / case_id / f"{case_id}_flair.nii.gz"
    shutil.copy(flair, flair.with_name(f"{case_id}_flair.nii"))
    error_line(invoke("data", "check", root), EXIT_BAD_INPUT, f"case {case_id}", "duplicate flair")


def test_unreadable_file(one_case, monkeypatch):
    """chmod 000 does not stop root (the tests run as root here), so the denial is simulated where the
    operating system would report it: the access check and the read of the file's bytes."""
    from brats_swap.data import nifti

    root, case_id = one_case
    denied = root / case_id / f"{case_id}_t2.nii.gz"
    real_access, real_open = nifti.os.access, nifti.open_regular

    def access(path, mode, *args, **kwargs):
        return False if str(path) == str(denied) else real_access(path, mode, *args, **kwargs)

    def open_file(path, *args, **kwargs):
        if str(path) == str(denied):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(nifti.os, "access", access)
    error_line(invoke("data", "check", "--strict", root), EXIT_BAD_INPUT, f"case {case_id}", denied.name,
               "permission denied")
    # Past the access check (e.g. a file that changed in between), the read's own PermissionError is reported too.
    monkeypatch.setattr(nifti.os, "access", real_access)
    monkeypatch.setattr(nifti, "open_regular", open_file)
    error_line(invoke("data", "check", "--strict", root), EXIT_BAD_INPUT, f"case {case_id}", denied.name,
               "ermission denied")


def test_single_bit_flips_in_a_compressed_file_are_never_read_as_data(one_case, tmp_path):
    """nibabel alone decodes most flipped bits of a .nii.gz silently into other voxels; the gzip CRC-32 and
    length must refuse every one (a flip that leaves the decompressed bytes unchanged, e.g. in a padding
    bit, is the only thing allowed through, and then the data is intact)."""
    root, case_id = one_case
    path = root / case_id / f"{case_id}_t2.nii.gz"
    original = path.read_bytes()
    half = len(original) // 2
    positions = np.linspace(half, len(original) - 1, 50).astype(int)
    refused = 0
    for number, position in enumerate(positions):
        damaged = bytearray(original)
        damaged[position] ^= 1 << (number % 8)
        path.write_bytes(bytes(damaged))
        result = invoke("data", "check", "--strict", root)
        if result.exit_code == 0:  # must then decode to exactly the original voxels
            assert gzip.decompress(bytes(damaged)) == gzip.decompress(original), f"byte {position} read as data"
            continue
        line = error_line(result, EXIT_BAD_INPUT, f"case {case_id}: file {path.name}: ")
        assert "damaged gzip data" in line or "unreadable or truncated" in line, line
        refused += 1
        last_refused = bytes(damaged)
    assert refused >= 45  # harmless flips are rare (a few in 100 000)
    # data prepare --strict refuses it the same way, and caches nothing.
    path.write_bytes(last_refused)
    cache = tmp_path / "cache"
    prepare = invoke("data", "prepare", root, "--out", cache, "--strict", *PREPARE_SETTINGS)
    error_line(prepare, EXIT_BAD_INPUT, f"case {case_id}", path.name, "gzip")
    assert not (cache / case_id).exists()


def test_unreadable_folder(one_case, monkeypatch):
    from brats_swap.data import discovery

    root, _ = one_case

    def walk(top, onerror=None, **kwargs):
        onerror(PermissionError(errno.EACCES, "Permission denied", str(top)))
        return iter(())

    monkeypatch.setattr(discovery.os, "walk", walk)
    error_line(invoke("data", "check", root), EXIT_BAD_INPUT, str(root), "Permission denied")


def test_debug_shows_the_traceback(one_case):
    root, case_id = one_case
    damage_nan(root / case_id)
    result = invoke("--debug", "data", "check", "--strict", root)
    assert result.exit_code == EXIT_BAD_INPUT
    assert "Traceback" in result.output and "DataError" in result.output



# --------------------------------------------------------------------------------------------------
# Bad data met by the later commands: train (the prepared cache), evaluate (ground truth), predict (input).


@pytest.mark.parametrize("loader_workers", [0, 1], ids=["in-process", "loader-worker"])
def test_train_on_a_damaged_cache_entry(writable_cache, tmp_path, loader_workers):
    from failure_helpers import set_args

    from brats_swap.data.cache import IMAGE_FILE, list_prepared
    from brats_swap.splits import fold_cases, make_splits

    # Every case but the first training case (which the loop opens at set-up): the damage is met inside
    # the DataLoader, in a worker process when there are workers.
    train_ids, _ = fold_cases(make_splits(list_prepared(writable_cache), 2, seed=0), 0)
    for case_id in list_prepared(writable_cache):
        if case_id != train_ids[0]:
            path = writable_cache / case_id / IMAGE_FILE
            path.write_bytes(path.read_bytes()[:1000])
    result = invoke("train", "--run", tmp_path / "run",
                    *set_args(writable_cache, f"data.loader_workers={loader_workers}", "train.max_epochs=1"))
    error_line(result, EXIT_BAD_INPUT, "case BraTS2021_000", IMAGE_FILE)


def test_train_on_a_missing_cache(tmp_path):
    from failure_helpers import set_args

    # With no prepared cases, train prepares them from data.root; with no data.root either, one line says so.
    cache, root = tmp_path / "no-cache", tmp_path / "no-data"
    error_line(invoke("train", "--run", tmp_path / "run", *set_args(cache, "data.cache_only=false"), "--set",
                      f"data.root={root}"),
               EXIT_BAD_INPUT, str(cache), "data.root", str(root))


def test_evaluate_with_damaged_ground_truth(run_copy, phantom_root, tmp_path):
    import json

    from failure_helpers import damage_labels

    data = tmp_path / "data"
    shutil.copytree(phantom_root, data)
    val_ids = json.loads((run_copy / "splits.json").read_text())["folds"][0]["val"]
    seg = data / val_ids[0] / f"{val_ids[0]}_seg.nii.gz"
    damage_labels(data / val_ids[0])
    error_line(invoke("evaluate", "--run", run_copy, "--fold", "0", "--data", data), EXIT_BAD_INPUT,
               f"case {val_ids[0]}", seg.name, "3")
    shutil.copy(phantom_root / val_ids[0] / seg.name, seg)
    seg.write_bytes(seg.read_bytes()[:300])  # truncated
    error_line(invoke("evaluate", "--run", run_copy, "--fold", "0", "--data", data), EXIT_BAD_INPUT,
               f"case {val_ids[0]}", seg.name)


def test_predict_on_a_bad_case(run_copy, one_case, tmp_path):
    root, case_id = one_case
    file_name = DAMAGES["other-affine"][0](root / case_id)
    out = tmp_path / "predictions"
    error_line(invoke("predict", "--run", run_copy, "--input", root, "--out", out), EXIT_BAD_INPUT,
               f"case {case_id}", file_name, "affine differs")
    assert not out.exists() or not list(out.iterdir())


def test_predict_on_a_missing_folder(run_copy, tmp_path):
    missing = tmp_path / "nothing"
    error_line(invoke("predict", "--run", run_copy, "--input", missing, "--out", tmp_path / "out"), EXIT_BAD_INPUT,
               str(missing), "not found")
