from __future__ import annotations

import json
import os
from collections import namedtuple

import numpy as np
import pytest
from data_helpers import write_case
from typer.testing import CliRunner

import brats_swap.data.cache as cache_module
from brats_swap.cli.data import app as data_app
from brats_swap.config import DataConfig
from brats_swap.data.cache import list_prepared, load_prepared, prepare_dataset
from brats_swap.data.compressed import CachedVolume
from brats_swap.data.discovery import discover_cases
from brats_swap.data.nifti import load_case
from brats_swap.data.preprocess import preprocess_case, preprocess_settings, to_original_grid
from brats_swap.errors import DataError

IDS = ["BraTS2021_00000", "BraTS2021_00001", "BraTS2021_00002"]


def _config(**changes):
    values = {"cube": [16, 16, 16], "prepare_workers": 1} | changes
    return DataConfig(**values)


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "raw"
    paths = {case_id: write_case(root, case_id, "2021", seed=i) for i, case_id in enumerate(IDS)}
    return root, tmp_path / "cache", paths


def _mtimes(cache):
    return {case_id: (cache / case_id / "meta.json").stat().st_mtime_ns for case_id in list_prepared(cache)}


def test_prepare_list_load_and_map_back(dataset):
    root, cache, _ = dataset
    report = prepare_dataset(root, cache, _config(fit="pad_crop", cube=[20, 20, 20]), progress=False)
    assert report.prepared == IDS and not report.failed
    assert list_prepared(cache) == IDS
    prepared = load_prepared(cache, IDS[1])
    assert isinstance(prepared.image, CachedVolume) and prepared.image.dtype == np.float16
    assert prepared.image.shape == (4, 20, 20, 20) and prepared.label.shape == (20, 20, 20)
    # Only the brain's box is stored, compressed; read back it is the preprocessed cube, bitwise, padded.
    assert not (cache / IDS[1] / "image.npy").exists()
    assert [b - a for a, b in prepared.meta["stored_box"]] == [16, 14, 10]
    image, label, _ = preprocess_case(load_case(discover_cases(root)[1]), preprocess_settings(
        _config(fit="pad_crop", cube=[20, 20, 20])))
    assert np.array_equal(np.asarray(prepared.image), image) and np.array_equal(np.asarray(prepared.label), label)
    assert np.array_equal(prepared.image[:, 1:9, 0:20, 12:20], image[:, 1:9, 0:20, 12:20])  # across the box edge
    whole = load_prepared(cache, IDS[1], mmap=False)
    assert isinstance(whole.image, np.ndarray) and np.array_equal(whole.image, image)
    meta = prepared.meta
    assert meta["edition"] == "2021" and meta["original_shape"] == [20, 18, 14] and len(meta["affine"]) == 4
    assert set(meta["sources"]) == {"t1", "t1ce", "t2", "flair", "seg"}
    original = load_case(discover_cases(root)[1]).seg
    assert np.array_equal(to_original_grid(np.asarray(prepared.label), meta), original)
    index = json.loads((cache / "index.json").read_text())
    assert list(index["cases"]) == IDS and index["settings"]["fit"] == "pad_crop"
    with pytest.raises(DataError, match="BraTS2021_00009 is not prepared"):
        load_prepared(cache, "BraTS2021_00009")


def test_incremental_second_run_does_nothing_and_touch_redoes_one(dataset):
    root, cache, paths = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    before = _mtimes(cache)
    again = prepare_dataset(root, cache, _config(), progress=False)
    assert again.prepared == [] and again.up_to_date == IDS
    assert _mtimes(cache) == before
    stat = paths[IDS[2]]["flair"].stat()
    os.utime(paths[IDS[2]]["flair"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    third = prepare_dataset(root, cache, _config(), progress=False)
    assert third.prepared == [IDS[2]] and third.up_to_date == IDS[:2]
    after = _mtimes(cache)
    assert after[IDS[0]] == before[IDS[0]] and after[IDS[2]] != before[IDS[2]]


def test_changed_settings_redo_everything(dataset):
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    report = prepare_dataset(root, cache, _config(cache_dtype="float32"), progress=False)
    assert report.prepared == IDS
    assert load_prepared(cache, IDS[0]).image.dtype == np.float32


def test_crash_mid_write_leaves_no_half_case(dataset, monkeypatch):
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    old_image = np.array(load_prepared(cache, IDS[0]).image)
    real_save = cache_module.write_volume
    calls = []

    def crashing_save(path, array):
        calls.append(path)
        if len(calls) == 2:  # image.b2nd written, label.b2nd not: the worst moment
            raise RuntimeError("simulated crash")
        real_save(path, array)

    monkeypatch.setattr(cache_module, "write_volume", crashing_save)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_dataset(root, cache, _config(cache_dtype="float32"), progress=False)
    # the old complete entry is untouched, no temp folder remains, nothing new is half there
    assert sorted(p.name for p in cache.iterdir()) == [*IDS, "index.json"]
    assert np.array_equal(np.array(load_prepared(cache, IDS[0]).image), old_image)
    assert load_prepared(cache, IDS[0]).meta["settings"]["cache_dtype"] == "float16"
    # the interrupted run's index only lists entries matching the new settings: none yet
    assert list_prepared(cache) == []
    monkeypatch.setattr(cache_module, "write_volume", real_save)
    assert prepare_dataset(root, cache, _config(cache_dtype="float32"), progress=False).prepared == IDS


def test_new_case_after_crash_and_stale_temp_folders_are_cleaned(dataset, monkeypatch):
    root, cache, _ = dataset
    monkeypatch.setattr(cache_module, "write_entry", _fail_on(IDS[1], cache_module.write_entry))
    with pytest.raises(RuntimeError):
        prepare_dataset(root, cache, _config(), progress=False)
    assert not (cache / IDS[1]).exists()
    assert list_prepared(cache) == [IDS[0]]
    # a SIGKILLed writer leaves its temp folder; pid 2**22 + 1 is above Linux's pid_max, so it is gone
    stale = cache / f".tmp-{IDS[2]}-{2**22 + 1}-deadbeef"
    stale.mkdir()
    (stale / "image.npy").write_bytes(b"half")
    monkeypatch.undo()
    report = prepare_dataset(root, cache, _config(), progress=False)
    assert report.removed_temp == 1 and not stale.exists()
    assert report.prepared == IDS[1:] and report.up_to_date == [IDS[0]]


def _fail_on(case_id, write_entry):
    def wrapped(cache_dir, this_case, *args, **kwargs):
        if this_case == case_id:
            raise RuntimeError("killed")
        return write_entry(cache_dir, this_case, *args, **kwargs)

    return wrapped


def test_bad_cases_are_skipped_or_strict_errors(dataset):
    root, cache, paths = dataset
    paths[IDS[1]]["t2"].write_bytes(b"broken")
    report = prepare_dataset(root, cache, _config(), progress=False)
    assert report.prepared == [IDS[0], IDS[2]]
    assert "case BraTS2021_00001: file BraTS2021_00001_t2.nii.gz: not a NIfTI file" in report.failed[IDS[1]]
    assert list_prepared(cache) == [IDS[0], IDS[2]]
    assert json.loads((cache / "index.json").read_text())["failed"].keys() == {IDS[1]}
    with pytest.raises(DataError, match="BraTS2021_00001_t2.nii.gz: not a NIfTI file"):
        prepare_dataset(root, tmp_cache := cache.with_name("strict"), _config(), strict=True, progress=False)
    assert IDS[1] not in list_prepared(tmp_cache)


def test_refuses_when_the_disk_is_too_small(dataset, monkeypatch):
    root, cache, _ = dataset
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(DataError, match=r"preparing 3 cases needs about .* GiB \(about .* MB each \(compressed; not measured yet\)\) but only 0.00 GiB is free"):
        prepare_dataset(root, cache, _config(), progress=False)
    assert not any(p.is_dir() for p in cache.iterdir())


def test_the_disk_budget_is_the_compressed_size_not_the_uncompressed_bound(dataset, monkeypatch):
    """Room for the compressed cases but not for the uncompressed bound: prepared (1,251 BraTS cases take 28 GB,
    their bound is 80 GB)."""
    root, cache, _ = dataset
    bound = cache_module.estimate_case_bytes(preprocess_settings(_config()))
    usage = namedtuple("usage", "total used free")
    free = int(3 * bound * 0.6)  # more than 3 x EXPECTED_SHARE x bound x margin, less than 3 x bound
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free))
    assert prepare_dataset(root, cache, _config(), workers=1, progress=False).prepared == IDS


def test_a_disk_that_fills_during_prepare_stops_it_early_and_keeps_the_cases(dataset, monkeypatch):
    """The budget is checked again once entries are measured: when the cases left no longer fit, prepare stops
    with one line, the cases already written are kept and listed in the index."""
    root, cache, _ = dataset
    usage = namedtuple("usage", "total used free")
    calls = []

    def disk_usage(path):  # plenty at the start; then someone else fills the disk
        calls.append(path)
        free = 10**12 if len(calls) == 1 else 1000
        return usage(10**12, 10**12 - free, free)

    monkeypatch.setattr(cache_module.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(cache_module, "MEASURE_AFTER", 2)
    with pytest.raises(DataError, match=r"preparing 1 cases needs about .* MB each, the mean of the 2 prepared "
                                        r"so far, which are kept\) but only 0.00 GiB is free"):
        prepare_dataset(root, cache, _config(), workers=1, progress=False)
    assert list_prepared(cache) == IDS[:2]
    assert sorted(json.loads((cache / "index.json").read_text())["cases"]) == IDS[:2]


@pytest.mark.slow  # spawns two worker processes (~5-9 s of interpreter + torch start-up)
def test_parallel_workers_give_the_same_arrays(dataset):
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), workers=1, progress=False)
    parallel = cache.with_name("parallel")
    report = prepare_dataset(root, parallel, _config(), workers=2, progress=False)
    assert report.prepared == IDS
    for case_id in IDS:
        a, b = load_prepared(cache, case_id), load_prepared(parallel, case_id)
        assert np.array_equal(a.image, b.image) and np.array_equal(a.label, b.label)


def test_prepare_command(dataset):
    root, cache, _ = dataset
    result = CliRunner().invoke(data_app, ["prepare", str(root), "--out", str(cache), "--set", "data.cube=[16,16,32]",
                                           "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "3 prepared, 0 up to date, 0 skipped" in " ".join(result.output.split())
    assert load_prepared(cache, IDS[0]).image.shape == (4, 16, 16, 32)


def test_prepare_missing_fills_in_what_the_cache_lacks(dataset, tmp_path):
    from brats_swap.data.cache import prepare_missing

    root, cache, _ = dataset
    cfg = _config(root=str(root), cache=str(cache))
    prepare_dataset(root, cache, cfg, progress=False)  # the first two cases were prepared before the third
    cache_module.shutil.rmtree(cache / IDS[2])
    before = _mtimes(cache)
    report = prepare_missing(cfg, progress=False)
    assert report.prepared == [IDS[2]] and report.up_to_date == IDS[:2] and report.cases == IDS
    assert list_prepared(cache) == IDS and all(_mtimes(cache)[k] == v for k, v in before.items() if k != IDS[2])
    assert prepare_missing(cfg, progress=False).prepared == []  # nothing left to do
    # Without the raw data the run is refused, naming both folders, unless the cache alone is the data;
    # without either there is nothing to train on.
    gone = _config(root=str(tmp_path / "moved-away"), cache=str(cache))
    with pytest.raises(DataError, match=rf"data.root .*moved-away is not a folder, .*{cache} was prepared from "
                                        rf"{root.resolve()}.*data.cache_only=true"):
        prepare_missing(gone, progress=False)
    assert prepare_missing(_config(root=str(tmp_path / "moved-away"), cache=str(cache), cache_only=True),
                           progress=False).cases == IDS
    with pytest.raises(DataError, match=r"no prepared cases .*data.root .*moved-away"):
        prepare_missing(_config(root=str(tmp_path / "moved-away"), cache=str(tmp_path / "empty")), progress=False)


def test_prepare_missing_prepares_a_fresh_cache_of_any_challenge(tmp_path):
    from brats_swap.data.cache import prepare_missing

    root = tmp_path / "raw"
    write_case(root, "BraTS-PED-00001-000", "ped")
    write_case(root, "BraTS-MEN-RT-0060-1", "men-rt")
    ped = prepare_missing(_config(root=str(root), cache=str(tmp_path / "c1")), progress=False)
    assert ped.prepared == ["BraTS-PED-00001-000"]  # MEN-RT ships t1c alone: skipped with all 4 modalities
    assert "ships no t1 image" in ped.failed["BraTS-MEN-RT-0060-1"]
    meta = load_prepared(tmp_path / "c1", "BraTS-PED-00001-000").meta
    assert meta["edition"] == "ped" and set(meta["label_counts"]) == {"1", "2", "3", "4"}
    men_rt_root = tmp_path / "men-rt"
    write_case(men_rt_root, "BraTS-MEN-RT-0060-1", "men-rt")
    men_rt = prepare_missing(_config(root=str(men_rt_root), cache=str(tmp_path / "c2"), modalities=["t1ce"],
                                     challenge="men-rt"), progress=False)
    assert men_rt.cases == ["BraTS-MEN-RT-0060-1"]
    prepared = load_prepared(tmp_path / "c2", "BraTS-MEN-RT-0060-1")
    assert prepared.image.shape[0] == 1 and prepared.meta["settings"]["challenge"] == "men-rt"
    assert set(np.unique(prepared.label)) == {0, 1}
    with pytest.raises(DataError, match="no usable case"):
        prepare_missing(_config(root=str(men_rt_root), cache=str(tmp_path / "c3")), progress=False)


# --------------------------------------------------------------------------------------------------
# Class locations (class_locations.npy): sampled at prepare, added to entries written before them.

def _without_locations(cache, case_id, kinds=("class", "region")):
    """The entry as format 2 wrote it before the cache stored class locations (and region locations), or
    only the region ones (`kinds=("region",)`)."""
    folder = cache / case_id
    meta = json.loads((folder / "meta.json").read_text())
    for kind in kinds:
        del meta[f"{kind}_locations"]
        (folder / f"{kind}_locations.npy").unlink()
    (folder / "meta.json").write_text(json.dumps(meta))


def _console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=300)


def test_entries_without_class_locations_get_them_from_their_label_alone(dataset, monkeypatch):
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    written = {case_id: ([(cache / case_id / f"{kind}_locations.npy").read_bytes() for kind in ("class", "region")],
                         load_prepared(cache, case_id).meta) for case_id in IDS}
    images = {case_id: (cache / case_id / "image.b2nd").stat().st_mtime_ns for case_id in IDS}
    _without_locations(cache, IDS[0])
    _without_locations(cache, IDS[1], kinds=("region",))  # written with class locations, before region ones
    with pytest.raises(DataError, match=rf"case {IDS[0]} has no tumour-class locations .*data prepare"):
        load_prepared(cache, IDS[0]).class_locations()

    def never(*args, **kwargs):
        raise AssertionError("read or compressed again")

    monkeypatch.setattr(cache_module, "load_case", never)  # no NIfTI is read
    monkeypatch.setattr(cache_module, "write_volume", never)  # nothing is compressed again
    sink = _console()
    report = prepare_dataset(root, cache, _config(), progress=False, console=sink)
    assert report.located == IDS[:2] and report.up_to_date == IDS and not report.prepared
    assert sink.file.getvalue().splitlines() == [
        f"{cache}: 2 case(s) were prepared before the cache stored their tumour-class and region locations; adding "
        "them from the cached labels (images and NIfTI files are not read again)"]
    for case_id in IDS:  # what prepare would have written from the NIfTI files, bitwise; the images untouched
        assert [(cache / case_id / f"{kind}_locations.npy").read_bytes()
                for kind in ("class", "region")] == written[case_id][0]
        assert load_prepared(cache, case_id).meta == written[case_id][1]
        assert (cache / case_id / "image.b2nd").stat().st_mtime_ns == images[case_id]
    again = prepare_dataset(root, cache, _config(), progress=False, console=(quiet := _console()))
    assert again.located == [] and quiet.file.getvalue() == ""


def test_a_cache_only_run_adds_the_class_locations_when_it_can_write(dataset, tmp_path, monkeypatch):
    from brats_swap.data.cache import prepare_missing

    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    _without_locations(cache, IDS[2])
    cache_only = _config(root=str(tmp_path / "no-download"), cache=str(cache), cache_only=True)
    monkeypatch.setattr(cache_module.os, "access", lambda path, mode: False)  # a read-only cache: left as it is
    assert prepare_missing(cache_only, progress=False).located == []
    assert not (cache / IDS[2] / "class_locations.npy").exists()
    monkeypatch.undo()
    report = prepare_missing(cache_only, progress=False, console=_console())
    assert report.located == [IDS[2]] and report.cases == IDS
    assert load_prepared(cache, IDS[2]).class_locations().classes


_DAMAGES = ["truncated", "header", "outside", "meta", "forged"]


@pytest.mark.parametrize("damage", _DAMAGES)
@pytest.mark.parametrize("kind", ["class", "region"])
def test_a_damaged_or_forged_locations_record_is_one_line_and_never_read_past_its_bounds(dataset, kind, damage):
    """class_locations / region_locations (.npy and meta.json) come from the cache's files: the file must hold
    exactly the rows meta.json lists, inside the cube; meta.json's counts must be label values (regions: the
    run's, each with its labels' checked voxels) with nnU-Net's rows of them."""
    from brats_swap.data.class_locations import default_regions

    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    folder = cache / IDS[0]
    path, meta = folder / f"{kind}_locations.npy", json.loads((folder / "meta.json").read_text())
    rows = np.load(path)
    assert len(rows) and (kind == "class" or [name for name, *_ in meta["region_locations"]] == ["WT", "TC", "ET"])
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-6])
    elif damage == "header":  # a file that claims a billion rows: refused before anything is allocated
        np.save(path, np.zeros((2, 3), np.uint16))
        path.write_bytes(path.read_bytes().replace(b"(2, 3)", b"(1000000000, 3)"))
    elif damage == "outside":
        rows[-1] = (0, 0, 16)  # the cube is 16³
        np.save(path, rows)
    else:
        meta[f"{kind}_locations"] = {
            ("class", "meta"): {"1": [10**9, 10000]}, ("class", "forged"): {"1": [5, 6]},
            ("region", "meta"): {"WT": [1, 1]},
            ("region", "forged"): [["WT", 10**9, 10**7], *meta["region_locations"][1:]]}[kind, damage]
        (folder / "meta.json").write_text(json.dumps(meta))
    expected = {"truncated": "shorter than its header says", "header": r"holds \(1000000000, 3\)",
                "outside": "outside the cube", "meta": "meta.json class_locations entry '1'",
                "forged": "meta.json class_locations entry '1'"}[damage]
    if kind == "region" and damage in ("meta", "forged"):
        expected = {"meta": "meta.json region_locations is not a list",
                    "forged": "meta.json region_locations entry 'WT'.*its labels' counts"}[damage]
    prepared = load_prepared(cache, IDS[0])
    with pytest.raises(DataError, match=rf"{IDS[0]}.*{expected}.*prepare the case again") as error:
        prepared.class_locations() if kind == "class" else prepared.region_locations(default_regions("2021"))
    assert "\n" not in str(error.value)


def test_a_class_locations_fifo_is_refused_without_blocking(dataset):
    """A cache copied from elsewhere (data.cache_only) whose class_locations.npy is a named pipe: one line, no
    wait for a writer that never comes (a loader worker would hang)."""
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    path = cache / IDS[0] / "class_locations.npy"
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(DataError, match=r"class_locations.npy: a FIFO \(named pipe\), not a regular file"):
        load_prepared(cache, IDS[0]).class_locations()


def test_an_entry_whose_label_cannot_be_read_is_prepared_again_instead(dataset):
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    expected = (cache / IDS[1] / "class_locations.npy").read_bytes()
    _without_locations(cache, IDS[1])
    label = cache / IDS[1] / "label.b2nd"
    label.write_bytes(label.read_bytes()[:100])
    report = prepare_dataset(root, cache, _config(), progress=False, console=_console())
    assert report.prepared == [IDS[1]] and report.located == [] and report.up_to_date == [IDS[0], IDS[2]]
    assert (cache / IDS[1] / "class_locations.npy").read_bytes() == expected
    assert list_prepared(cache) == IDS


def test_a_meta_or_index_fifo_never_blocks_prepare(dataset):
    """meta.json and index.json are read only as regular files. A named pipe as index.json: the index is
    unknown and written again. A named pipe as an entry's meta.json: the folder is not recognised as an entry
    brats-swap wrote, and is refused in one line, left as it is. Neither waits for a writer."""
    root, cache, _ = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    (cache / "index.json").unlink()
    os.mkfifo(cache / "index.json")
    assert prepare_dataset(root, cache, _config(), progress=False).up_to_date == IDS
    assert list_prepared(cache) == IDS
    meta = cache / IDS[1] / "meta.json"
    meta.unlink()
    os.mkfifo(meta)
    with pytest.raises(DataError, match=rf"{IDS[1]} is there but was not written by brats-swap") as error:
        prepare_dataset(root, cache, _config(), progress=False)
    assert "\n" not in str(error.value) and meta.exists()
