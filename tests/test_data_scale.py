"""A dataset at full size (issue 42): every core by default, progress lines in logs, an index complete after a
stop, old cache formats rebuilt, the cache's source checked. Small shapes; scripts/bench_scale.py measures
the real geometry."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
from data_helpers import link_case, write_case
from rich.console import Console
from typer.testing import CliRunner

import brats_swap.data.cache as cache_module
from brats_swap.cli.data import app as data_app
from brats_swap.config import DataConfig
from brats_swap.data import workers
from brats_swap.data.cache import list_prepared, load_prepared, prepare_dataset, prepare_missing
from brats_swap.data.check import check_dataset
from brats_swap.errors import DataError, PreparationInterrupted
from brats_swap.progress import ProgressLines
from brats_swap.train import data as train_data

IDS = ["BraTS2021_00000", "BraTS2021_00001", "BraTS2021_00002"]


def _config(**changes):
    return DataConfig(**({"cube": [16, 16, 16], "prepare_workers": 1} | changes))


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "raw"
    for i, case_id in enumerate(IDS):
        write_case(root, case_id, "2021", seed=i)
    return root, tmp_path / "cache"


def _sink() -> Console:
    return Console(file=io.StringIO(), width=300)


def test_workers_auto_is_every_cpu_of_the_process_as_the_loader_counts_them(dataset, monkeypatch):
    assert workers.resolve_workers("auto") == len(os.sched_getaffinity(0)) and workers.resolve_workers(3) == 3
    assert DataConfig().prepare_workers == "auto"
    monkeypatch.setattr(workers, "available_cpus", lambda: 9)
    monkeypatch.setattr(train_data, "available_cpus", lambda: 9)
    assert workers.resolve_workers("auto") == 9
    assert train_data.loader_worker_count(DataConfig()) == 8  # the loader's rule on the same count
    used = []
    monkeypatch.setattr(cache_module, "run_cases", lambda fn, jobs, count, **_: used.append(count))
    root, cache = dataset
    prepare_dataset(root, cache, DataConfig(cube=[16, 16, 16]), progress=False)
    assert used == [9]


def test_check_in_two_processes_says_what_one_process_says(dataset):
    root, _ = dataset
    (root / IDS[1] / f"{IDS[1]}_t2.nii.gz").write_bytes(b"not gzip")  # one bad case
    one = check_dataset(root, progress=False, workers=1)
    two = check_dataset(root, progress=False, workers=2)
    assert [r.case_id for r in two] == IDS and two == one
    assert two[1].problem and two[0].ok and two[0].label_counts


def test_prepare_and_check_print_progress_lines_in_a_log(dataset, monkeypatch):
    monkeypatch.setattr(workers, "PROGRESS_LINE_SECONDS", 0.0)
    root, cache = dataset
    (root / IDS[1] / f"{IDS[1]}_t2.nii.gz").write_bytes(b"not gzip")
    sink = _sink()
    prepare_dataset(root, cache, _config(), console=sink)
    lines = sink.file.getvalue().splitlines()
    assert lines[0].startswith("prepare case 1/3, ") and "left" in lines[0] and "cases/s" in lines[0]
    assert lines[1].startswith("prepare case 2/3, ") and lines[1].endswith("1 failed")  # cases in order here
    sink = _sink()
    check_dataset(root, progress=True, console=sink)
    assert sink.file.getvalue().startswith("check case 1/3, ")
    # The prepare step of train / cv / compare prints them on the run's console (stderr) too.
    monkeypatch.setattr(train_data, "console", sink := _sink())
    train_data.prepare_run_data(_config(root=str(root), cache=str(root.parent / "cache2")))
    assert sink.file.getvalue().startswith("prepare case 1/3, ")
    result = CliRunner().invoke(data_app, ["prepare", str(root), "--out", str(root.parent / "cache3"),
                                           "--workers", "1"])
    assert "prepare case 2/3, " in result.output


def test_a_line_comes_even_when_no_case_has_finished():
    now = [0.0]
    sink = _sink()
    lines = ProgressLines("prepare", 10, console=sink, unit="case", every_s=60.0, clock=lambda: now[0])
    now[0] = 61.0
    lines.update(0, "0 failed")  # the pool loop wakes up without a finished case
    now[0] = 70.0
    lines.update(1, "0 failed")  # not due yet
    now[0] = 125.0
    lines.update(2, "0 failed")
    assert sink.file.getvalue().splitlines() == [
        "prepare case 0/10, 0:01:01 elapsed, time left not known yet  0 failed",  # no rate before a case is done
        "prepare case 2/10, 0:02:05 elapsed, about 0:08:20 left  0.02 cases/s  0 failed"]


def test_the_index_lists_every_case_finished_before_a_stop(dataset, monkeypatch):
    """Ctrl-C just after a case's entry is complete on disk and before the run recorded it: the index lists it."""
    root, cache = dataset
    real_write = cache_module.write_entry
    written = []

    def write_then_stop(cache_dir, case_id, *args):
        real_write(cache_dir, case_id, *args)
        written.append(case_id)
        if len(written) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cache_module, "write_entry", write_then_stop)
    with pytest.raises(PreparationInterrupted):  # Ctrl-C, said with what is kept (issue 54.8)
        prepare_dataset(root, cache, _config(), progress=False)
    assert list_prepared(cache) == IDS[:2] == written
    monkeypatch.setattr(cache_module, "write_entry", real_write)
    report = prepare_dataset(root, cache, _config(), progress=False)  # resume redoes nothing
    assert report.up_to_date == IDS[:2] and report.prepared == IDS[2:]


def _make_old_format(cache, case_id):
    """An entry as format 1 wrote it: the whole cube uncompressed, meta.json without `cache_format`."""
    whole = load_prepared(cache, case_id, mmap=False)
    folder = cache / case_id
    np.save(folder / "image.npy", whole.image)
    np.save(folder / "label.npy", whole.label)
    (folder / "image.b2nd").unlink()
    (folder / "label.b2nd").unlink()
    meta = {k: v for k, v in whole.meta.items() if k not in ("cache_format", "stored_box")}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_an_old_format_entry_is_never_read_and_is_rebuilt_with_one_line(dataset):
    root, cache = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    expected = np.asarray(load_prepared(cache, IDS[0]).image)
    _make_old_format(cache, IDS[0])
    with pytest.raises(DataError, match=rf"case {IDS[0]} is in an older cache format .*data prepare"):
        load_prepared(cache, IDS[0])
    sink = _sink()
    report = prepare_dataset(root, cache, _config(), progress=False, console=sink)
    assert report.prepared == [IDS[0]] and report.up_to_date == IDS[1:] and report.old_format == 1
    assert sink.file.getvalue().splitlines() == [
        f"{cache}: 1 case(s) are in an older cache format (uncompressed image.npy); rebuilding them in format 2 "
        "(compressed, docs/data.md)"]
    assert not (cache / IDS[0] / "image.npy").exists()
    assert np.array_equal(np.asarray(load_prepared(cache, IDS[0]).image), expected)


def test_a_run_on_another_dataset_than_the_caches_is_refused_naming_both(dataset, tmp_path):
    root, cache = dataset
    prepare_missing(_config(root=str(root), cache=str(cache)), progress=False)
    assert json.loads((cache / "index.json").read_text())["source"]["root"] == str(root.resolve())
    other = tmp_path / "other"
    write_case(other, "BraTS2021_00100", "2021", seed=5)
    with pytest.raises(DataError, match=rf"data.root {other} .*is not the dataset the cache {cache} was prepared "
                                        rf"from \({root}, 3 cases.*data.cache_only=true"):
        prepare_missing(_config(root=str(other), cache=str(cache)), progress=False)
    assert list_prepared(cache) == IDS  # nothing was touched
    # The same dataset copied elsewhere is the same data: accepted, nothing redone, the new place recorded.
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    report = prepare_missing(_config(root=str(copy), cache=str(cache)), progress=False)
    assert report.prepared == [] or report.prepared == IDS  # copies get new mtimes: re-prepared, same data
    assert json.loads((cache / "index.json").read_text())["source"]["root"] == str(copy.resolve())
    # The user says the cache is the data: the other root is not even looked at.
    assert prepare_missing(_config(root=str(other), cache=str(cache), cache_only=True), progress=False).cases == IDS


def test_train_with_a_wrong_data_root_is_refused_in_one_line(dataset, tmp_path):
    from brats_swap.cli.main import app

    root, cache = dataset
    prepare_dataset(root, cache, _config(), progress=False)
    prepare_missing(_config(root=str(root), cache=str(cache)), progress=False)
    result = CliRunner().invoke(app, ["train", "--run", str(tmp_path / "run"), "--set", "data.cube=[16,16,16]",
                                      "--set", f"data.cache={cache}", "--set", f"data.root={tmp_path / 'nothere'}"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nothere is not a folder" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_cases_the_worker_processes_finish_while_stopping_are_in_the_index(tmp_path, monkeypatch):
    """Ctrl-C reaches the main process as the first case comes back from a pool of two: the case the other
    process holds is finished (workers ignore Ctrl-C) and listed; the index lists exactly what is on disk."""
    root, cache = tmp_path / "raw", tmp_path / "cache"
    ids = [f"BraTS2021_{k:05d}" for k in range(6)]
    for k, case_id in enumerate(ids):
        write_case(root, case_id, "2021", seed=k)

    def stop(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module, "_note_cropped", stop)  # runs as each finished case is recorded
    with pytest.raises(PreparationInterrupted):  # Ctrl-C, said with what is kept (issue 54.8)
        prepare_dataset(root, cache, _config(), workers=2, progress=False)
    on_disk = sorted(p.name for p in cache.iterdir() if (p / "meta.json").is_file())
    assert len(on_disk) >= 2 and list_prepared(cache) == on_disk
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_a_cached_volume_reads_any_window_as_the_padded_cube_does(tmp_path, monkeypatch):
    """Several chunks per axis (edge 4), a box off the cube's centre: every window, read chunk by chunk, equals
    the same window of the zero-padded cube, bitwise."""
    from brats_swap.data import compressed

    monkeypatch.setattr(compressed, "CHUNK_EDGE", 4)
    rng = np.random.default_rng(0)
    cube = np.zeros((2, 13, 11, 9), dtype=np.float16)
    cube[:, 2:12, 1:8, 3:9] = rng.normal(size=(2, 10, 7, 6))
    box = compressed.content_box(cube, None)
    assert box == [[2, 12], [1, 8], [3, 9]]
    compressed.write_volume(tmp_path / "v.b2nd", cube[:, 2:12, 1:8, 3:9])
    volume = compressed.CachedVolume(tmp_path / "v.b2nd", cube.shape, cube.dtype, box)
    assert np.array_equal(np.asarray(volume), cube)
    for _ in range(40):
        lo = [int(rng.integers(0, n)) for n in cube.shape[1:]]
        hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, cube.shape[1:], strict=True)]
        window = (slice(None), *(slice(a, b) for a, b in zip(lo, hi, strict=True)))
        out = np.full(cube[window].shape, 7, dtype=np.float16)  # stale values must not survive
        volume.window(window).read_into(out)
        assert np.array_equal(out, cube[window]) and np.array_equal(volume[window], cube[window])


def test_ctrl_c_to_a_prepare_in_a_log_leaves_an_index_of_every_complete_entry(tmp_path):
    """The issue's case, end to end: `data prepare --workers 2` with output to a file, SIGINT to its process
    group (a Ctrl-C) once some cases are on disk: exit 130, and index.json lists exactly the complete entries."""
    import signal
    import subprocess
    import sys
    import time

    root, cache = tmp_path / "raw", tmp_path / "cache"
    ids = [f"BraTS2021_{k:05d}" for k in range(40)]
    # 40 cases so that the prepare is still running when 2 are done; 4 are written, the rest linked to them
    # (each is prepared on its own all the same).
    written = [write_case(root, case_id, "2021", shape=(96, 96, 64), seed=k) for k, case_id in enumerate(ids[:4])]
    for k, case_id in enumerate(ids[4:]):
        link_case(written[k % 4], root, case_id)
    log = (tmp_path / "prepare.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "brats_swap", "data", "prepare", str(root), "--out", str(cache), "--workers", "2",
         "--set", "data.cube=[64,64,64]"], stdout=log, stderr=log, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if cache.is_dir() and sum((p / "meta.json").is_file() for p in cache.iterdir()) >= 2:
            break
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=120) == 130
    on_disk = sorted(p.name for p in cache.iterdir() if (p / "meta.json").is_file())
    assert 2 <= len(on_disk) < len(ids)  # stopped part-way
    assert list_prepared(cache) == on_disk
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
